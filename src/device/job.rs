//! Block jobs: work on the image's chain that runs beside the guest, one
//! at a time per device. A stream ([`Live::stream_step`]) copies
//! the data of the layers between the top and a base up into the top; a
//! commit ([`Live::commit_step`]) copies a layer below the top (and those
//! down to a base) down into the base; either then drops those layers
//! from the chain ([`Live::rebase`]). An active commit copies the top
//! itself into the base while its own dirty bitmap (marked as the
//! device's bitmaps are, `super::tracking`) follows the guest's writes,
//! copies what they changed again, pass after pass, until a pass leaves
//! at most [`CONVERGED`] bytes, then copies those with the queues
//! quiesced and pivots: the base becomes the top ([`Live::pivot`]).
//!
//! A job runs on a thread of its own and holds the image (its lock, its
//! bitmaps) until it ends, also with no front-end connected. It copies one
//! stretch at a time ([`STRETCH`]), checking between stretches whether it
//! was cancelled or the daemon is stopping, and keeps to its speed by
//! sleeping (without one, it works a quarter of the time at most). A job, a backup and a live
//! snapshot refuse each other (each would change or read the chain under
//! the other); so does a migration under way. The old layers are never
//! deleted: the job's answer says which files the chain no longer uses.
//!
//! After a kill -9 or a power loss during a job the chain on disk is the
//! old one (what was copied reads the same through it) or, once the
//! switch's header write (an active commit's: the removal of a snapshot
//! record) is durable, the new one; either serves correctly after a
//! restart. The job's record in the snapshot directory
//! ([`crate::disk::records::JOB_RECORD`]) then has the restarted daemon
//! show it as interrupted (or completed); started again, it skips what
//! was copied.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;

use super::Device;
use crate::disk::records::JobRecord;
use crate::disk::{CommitBase, Live};

/// What a job copies at a time: the longest the guest's own metadata work
/// waits behind a stream (each of its stretches holds the image's
/// metadata locks), and what a stretch's fdatasyncs are paid for (1 MiB
/// stretches cost the guest more).
pub const STRETCH: u64 = 8 << 20;

/// An active commit pivots once the guest changed at most this much since
/// its last pass: what is copied with the guest's queues held.
pub const CONVERGED: u64 = STRETCH;

/// The smallest granule of an active commit's dirty bitmap.
const MIRROR_GRANULE: u64 = 64 << 10;

/// How long a cancel waits for the job to see it.
const CANCEL_WAIT: Duration = Duration::from_secs(30);

/// Why a job cannot start or be changed.
#[derive(Debug, thiserror::Error)]
pub enum JobError {
    /// The request is wrong whatever the state: bad input, no chain.
    #[error("{0}")]
    Invalid(String),
    /// Another operation is in the way (a job, a backup, a migration).
    #[error("{0}")]
    Conflict(String),
    /// No job has run on this device.
    #[error("no job has run on this device")]
    NoJob,
    /// The job could not be started (its record, its thread).
    #[error("{0}")]
    Io(String),
}

/// A job's state.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum JobState {
    Running,
    Completed,
    Cancelled,
    Failed,
    /// Cut short by a crash or a kill of the daemon (found at start-up):
    /// the chain is as it was; started again, the job goes on from what
    /// was copied.
    Interrupted,
}

/// What `job status` shows.
#[derive(Clone, Debug, Serialize)]
pub struct JobInfo {
    /// "stream" or "commit".
    pub kind: &'static str,
    pub state: JobState,
    /// Guest bytes looked at so far, out of `total`.
    pub done: u64,
    pub total: u64,
    /// Bytes copied up so far.
    pub copied: u64,
    /// The speed limit in bytes per second (0: none).
    pub speed: u64,
    /// The layer that becomes the top's backing file (none: the top
    /// stands alone).
    pub base: Option<String>,
    /// The chain, top first: as it is now (after a completed stream, the
    /// new one).
    pub chain: Vec<String>,
    /// Files the chain no longer uses once the job completed (never
    /// deleted by the daemon).
    pub unused: Vec<String>,
    /// Why it failed.
    pub error: Option<String>,
    /// An active commit (of the top, with a pivot).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub active: bool,
    /// An active commit that copied what the layers had: bytes the guest
    /// changed since its last pass, which the next copies (the pivot comes
    /// once they are at most [`CONVERGED`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub remaining: Option<u64>,
    /// An active commit: the passes over what the guest changed, after
    /// the first copy.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub passes: Option<u64>,
}

/// A job as the device keeps it.
pub struct Job {
    /// "stream" or "commit".
    kind: &'static str,
    active: bool,
    /// An active commit copied what the layers had and follows the
    /// guest's writes now.
    mirroring: AtomicBool,
    passes: AtomicU64,
    base: Option<String>,
    total: u64,
    done: AtomicU64,
    copied: AtomicU64,
    speed: u64,
    cancel: AtomicBool,
    state: Mutex<(JobState, Option<String>, Vec<String>)>,
    live: Arc<Live>,
}

impl Job {
    fn info(&self) -> JobInfo {
        let (state, error, unused) = self.state.lock().unwrap_or_else(|e| e.into_inner()).clone();
        JobInfo {
            kind: self.kind,
            state,
            done: self.done.load(Ordering::Relaxed),
            total: self.total,
            copied: self.copied.load(Ordering::Relaxed),
            speed: self.speed,
            base: self.base.clone(),
            chain: self
                .live
                .chain()
                .iter()
                .map(|p| p.display().to_string())
                .collect(),
            unused,
            error,
            active: self.active,
            remaining: None,
            passes: self.active.then(|| self.passes.load(Ordering::Relaxed)),
        }
    }

    fn running(&self) -> bool {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).0 == JobState::Running
    }

    fn end(&self, state: JobState, error: Option<String>, unused: Vec<String>) {
        self.live.clear_job();
        *self.state.lock().unwrap_or_else(|e| e.into_inner()) = (state, error, unused);
    }
}

impl Device {
    /// The job running or last run, if any.
    pub fn job(&self) -> Option<JobInfo> {
        let job = self.job_slot().clone()?;
        let mut info = job.info();
        if job.mirroring.load(Ordering::Relaxed) && info.state == JobState::Running {
            info.remaining = Some(self.mirror_dirty());
        }
        Some(info)
    }

    /// A line saying which job runs, for what it keeps out.
    pub(super) fn job_running(&self) -> Option<String> {
        self.job_slot().as_ref().filter(|j| j.running()).map(|j| {
            format!(
                "a {} job is running; wait for it or `job cancel` it first",
                j.kind
            )
        })
    }

    fn job_slot(&self) -> std::sync::MutexGuard<'_, Option<Arc<Job>>> {
        self.job.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Starts a stream (see the module doc): `base` is a file of the
    /// chain below the top (as `ctl status` lists it), or none; `speed`
    /// in bytes per second, or none: a quarter of the time at most.
    pub fn stream(
        self: &Arc<Self>,
        base: Option<&Path>,
        speed: Option<u64>,
    ) -> Result<JobInfo, JobError> {
        let invalid = |why: String| Err(JobError::Invalid(why));
        let (live, chain) = self.job_chain("stream", speed)?;
        let base_index = match base {
            None => chain.len(),
            Some(b) => find_in_chain(&chain, b)?,
        };
        if base_index == 0 {
            return invalid(format!(
                "--base {}: that is the top, which a stream copies into; name a layer below it",
                chain[0].display()
            ));
        }
        if chain.len() == 1 {
            return invalid(format!(
                "{} has no backing file: there is nothing to stream",
                chain[0].display()
            ));
        }
        self.start_job(&live, Work::Stream, base_index, base.is_some(), speed)
    }

    /// Starts a commit (see the module doc): `top`, a read-only layer of
    /// the chain (today the one right below the top), and the layers down
    /// to `base` (default: `top`'s backing file) are copied into `base`,
    /// which the layer above `top` then points at.
    pub fn commit(
        self: &Arc<Self>,
        top: &Path,
        base: Option<&Path>,
        speed: Option<u64>,
    ) -> Result<JobInfo, JobError> {
        let invalid = |why: String| Err(JobError::Invalid(why));
        let (live, chain) = self.job_chain("commit", speed)?;
        let t = find_in_chain(&chain, top)?;
        let b = match base {
            None => t + 1,
            Some(b) => find_in_chain(&chain, b)?,
        };
        if b <= t {
            return invalid(format!(
                "--base {}: a commit's base is below its top",
                chain[b].display()
            ));
        }
        if b >= chain.len() {
            return invalid(format!(
                "--top {}: it has no backing file to commit into",
                top.display()
            ));
        }
        if t > 1 {
            // The layer above --top gets the new backing file.
            live.check_writable(t - 1)
                .map_err(|e| JobError::Invalid(e.to_string()))?;
        }
        let written = live
            .open_base(b, t == 0)
            .map_err(|e| JobError::Invalid(e.to_string()))?;
        let work = if t == 0 {
            Work::Active(written)
        } else {
            Work::Commit(t, written)
        };
        self.start_job(&live, work, b, true, speed)
    }

    /// The chain a `kind` job would work on, and its files (top first),
    /// once the checks every job makes pass.
    fn job_chain(
        &self,
        kind: &str,
        speed: Option<u64>,
    ) -> Result<(Arc<Live>, Vec<PathBuf>), JobError> {
        let invalid = |why: String| Err(JobError::Invalid(why));
        let Some(live) = self.backing.chain().cloned() else {
            return invalid(format!(
                "a {kind} needs an image with a backing chain (serve --format qcow2)"
            ));
        };
        if self.limits.readonly {
            return invalid("the image is served read-only (--readonly)".into());
        }
        if speed == Some(0) {
            return invalid("--speed 0 would never finish; leave it out for no limit".into());
        }
        let chain = live.chain();
        Ok((live, chain))
    }

    /// What [`Device::stream`] and [`Device::commit`] share once their
    /// request is checked: the conflicts, the record, the thread.
    fn start_job(
        self: &Arc<Self>,
        live: &Arc<Live>,
        work: Work,
        base_index: usize,
        named_base: bool,
        speed: Option<u64>,
    ) -> Result<JobInfo, JobError> {
        let kind = work.kind();
        let chain = live.chain();
        let _chain = self.chain_change.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(b) = self.backup() {
            return Err(JobError::Conflict(format!(
                "a backup is running (NBD on {}); a {kind} would change the chain under its view: `backup stop` it first",
                b.socket
            )));
        }
        if self.logging() {
            return Err(JobError::Conflict(
                "a migration is under way; start the job on the destination once it is over".into(),
            ));
        }
        let mut slot = self.job_slot();
        if let Some(j) = slot.as_ref().filter(|j| j.running()) {
            return Err(JobError::Conflict(format!(
                "a {} job is running already; one job at a time (`job cancel` it first)",
                j.kind
            )));
        }
        // Recorded before it starts: a restart after a crash says it was
        // cut short.
        let active = matches!(work, Work::Active(_));
        let record = match &work {
            Work::Active(_) => JobRecord::active_commit(&chain, base_index),
            Work::Commit(top, _) => JobRecord::commit(&chain, *top, base_index),
            Work::Stream => JobRecord::new(kind, &chain, base_index),
        };
        live.record_job(&record)
            .map_err(|e| JobError::Io(format!("the job cannot be recorded: {e}")))?;
        let job = Arc::new(Job {
            kind,
            active,
            mirroring: AtomicBool::new(false),
            passes: AtomicU64::new(0),
            base: named_base.then(|| chain[base_index].display().to_string()),
            total: live.size(),
            done: AtomicU64::new(0),
            copied: AtomicU64::new(0),
            speed: speed.unwrap_or(0),
            cancel: AtomicBool::new(false),
            state: Mutex::new((JobState::Running, None, Vec::new())),
            live: live.clone(),
        });
        let device = self.clone();
        let run = job.clone();
        std::thread::Builder::new()
            .name("job".into())
            .spawn(move || device.run_job(&run, work, base_index))
            .map_err(|e| {
                live.clear_job();
                JobError::Io(format!("starting the job's thread: {e}"))
            })?;
        *slot = Some(job.clone());
        log::info!(
            "{}: {kind} started on the chain {}, base {}",
            self.name,
            chain
                .iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(", "),
            job.base
                .as_deref()
                .unwrap_or("none (the top will stand alone)")
        );
        Ok(job.info())
    }

    /// At start-up: the job record a daemon that stopped in the middle of
    /// a job left (see [`crate::disk::records::job`]). Its job shows as
    /// `completed` when the chain is already the one it was making (the
    /// crash came after its switch), else `interrupted`, until the next
    /// job starts.
    pub fn recover_job(&self, record: JobRecord) {
        let Some(live) = self.backing.chain().cloned() else {
            return;
        };
        let chain: Vec<String> = live
            .chain()
            .iter()
            .map(|p| p.display().to_string())
            .collect();
        let switched = if record.active {
            chain.first() == record.base.as_ref()
        } else {
            chain.first() == Some(&record.top)
                && record.base.as_ref().is_none_or(|b| chain.contains(b))
        } && !record.drops.iter().any(|d| chain.contains(d));
        let (state, error) = if switched {
            (JobState::Completed, None)
        } else {
            log::warn!(
                "{}: a {} job started {} was cut short (the daemon stopped in its middle); the chain is as it was: start it again to finish it (what it copied is kept)",
                self.name,
                record.kind,
                crate::disk::records::utc(record.at)
            );
            (
                JobState::Interrupted,
                Some(
                    "cut short when the daemon stopped; the chain is as it was: start it again (what it copied is kept)"
                        .to_string(),
                ),
            )
        };
        let unused = if switched {
            record.drops.clone()
        } else {
            Vec::new()
        };
        let kind = if record.kind == "commit" {
            "commit"
        } else {
            "stream"
        };
        *self.job_slot() = Some(Arc::new(Job {
            kind,
            active: record.active,
            mirroring: AtomicBool::new(false),
            passes: AtomicU64::new(0),
            base: record.base,
            total: live.size(),
            done: AtomicU64::new(0),
            copied: AtomicU64::new(0),
            speed: 0,
            cancel: AtomicBool::new(false),
            state: Mutex::new((state, error, unused)),
            live,
        }));
    }

    /// Asks the running job to stop; returns once it has (its state is
    /// then `cancelled`, or `completed` if it was past its switch).
    pub fn job_cancel(&self) -> Result<JobInfo, JobError> {
        let Some(job) = self.job_slot().clone() else {
            return Err(JobError::NoJob);
        };
        job.cancel.store(true, Ordering::Relaxed);
        let deadline = Instant::now() + CANCEL_WAIT;
        while job.running() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        Ok(job.info())
    }

    /// A migration starts (the front-end acked dirty logging): the
    /// running job, if any, is told to stop at its next stretch, and lets
    /// the image go then (its chain as it was); it is not waited for here,
    /// on the front-end's thread.
    pub(super) fn cancel_job_for_migration(&self) {
        if let Some(job) = self.job_slot().as_ref().filter(|j| j.running()) {
            log::warn!(
                "{}: a migration started: the {} job is cancelled (start it again on the destination once the migration is over)",
                self.name,
                job.kind
            );
            job.cancel.store(true, Ordering::Relaxed);
        }
    }

    /// The daemon stops: the running job, if any, is cancelled and
    /// waited for (its stretch finished and committed), so that nothing
    /// writes the image after it is made durable.
    pub fn stop_job(&self) {
        let running = self.job_slot().clone().filter(|j| j.running());
        if running.is_some() {
            let _ = self.job_cancel();
        }
    }

    /// The job's thread: copies, then switches.
    fn run_job(&self, job: &Job, work: Work, base: usize) {
        let kind = work.kind();
        let fail = |why: String| {
            log::error!("{}: {kind} failed: {why}", self.name);
            job.end(JobState::Failed, Some(why), Vec::new());
        };
        let hold = match self.hold_guard() {
            Ok(h) => h,
            Err(e) => return fail(format!("the image cannot be held: {e}")),
        };
        let active = matches!(work, Work::Active(_));
        if let Work::Active(into) = &work {
            // Before the first copy: every write from here on is marked,
            // and copied again after it.
            // At least 64 KiB granules: a disk of 512-byte clusters
            // would cost a bitmap of a bit per sector (a granule copies
            // every cluster of the base it covers).
            if let Err(e) = self.mirror_start(into.cluster_size().max(MIRROR_GRANULE)) {
                return fail(format!("tracking the guest's writes: {e}"));
            }
        }
        // Cancelled, or failed, before the switch: an active commit stops
        // tracking, and the chain is as it was.
        let give_up = |state: JobState, why: Option<String>| {
            if active {
                self.mirror_end(|_| ());
            }
            match &why {
                Some(w) => log::error!("{}: {kind} failed: {w}", self.name),
                None => log::info!("{}: {kind} cancelled; the chain is as it was", self.name),
            }
            job.end(state, why, Vec::new());
        };
        let started = Instant::now();
        let mut offset = 0;
        while offset < job.total {
            if job.cancelled(self) {
                drop(hold);
                return give_up(JobState::Cancelled, None);
            }
            let stretch = STRETCH.max(job.live.cluster_size());
            let took = Instant::now();
            let stepped = match &work {
                Work::Stream => job.live.stream_step(base, offset, stretch),
                Work::Commit(top, into) => job.live.commit_step(into, *top, base, offset, stretch),
                Work::Active(into) => job.live.commit_step(into, 0, base, offset, stretch),
            };
            match stepped {
                Ok(step) => {
                    job.done.fetch_add(step.examined, Ordering::Relaxed);
                    offset += step.examined.max(1);
                    job.pace(step.copied, took, started);
                }
                Err(e) => {
                    drop(hold);
                    return give_up(
                        JobState::Failed,
                        Some(format!("copying at byte {offset}: {e}")),
                    );
                }
            }
        }
        let before = job.live.chain();
        let switched = match work {
            Work::Commit(top, into) => job.live.rebase(top - 1, base, Some(&into)),
            Work::Stream => job.live.rebase(0, base, None),
            Work::Active(into) => match self.converge(job, &into, base, started) {
                Ok(true) => self.pivot(job, into, base),
                Ok(false) => {
                    drop(hold);
                    return give_up(JobState::Cancelled, None);
                }
                Err(e) => {
                    drop(hold);
                    return give_up(JobState::Failed, Some(e));
                }
            },
        };
        match switched {
            Ok(chain) => {
                let unused: Vec<String> = before
                    .iter()
                    .filter(|p| !chain.contains(p))
                    .map(|p| p.display().to_string())
                    .collect();
                log::info!(
                    "{}: {kind} completed: the chain is now, top first, {}; no longer used (not deleted): {}",
                    self.name,
                    chain
                        .iter()
                        .map(|p| p.display().to_string())
                        .collect::<Vec<_>>()
                        .join(", "),
                    if unused.is_empty() {
                        "none".to_string()
                    } else {
                        unused.join(", ")
                    }
                );
                drop(hold);
                job.end(JobState::Completed, None, unused);
            }
            Err(e) => fail(format!("switching the chain: {e}")),
        }
    }

    /// An active commit's passes after its first: while the guest changed
    /// more than [`CONVERGED`] bytes since the last, the bitmap is swapped
    /// for an empty one and what it had is copied again. `Ok(false)`:
    /// cancelled (the caller stops the tracking).
    fn converge(
        &self,
        job: &Job,
        into: &CommitBase,
        base: usize,
        started: Instant,
    ) -> Result<bool, String> {
        job.mirroring.store(true, Ordering::Relaxed);
        while self.mirror_dirty() > CONVERGED {
            let Some(pass) = self.mirror_swap() else {
                return Err("the tracking of the guest's writes is gone".into());
            };
            job.passes.fetch_add(1, Ordering::Relaxed);
            let extents = pass.dirty_extents();
            for chunk in stretches(&extents, STRETCH) {
                if job.cancelled(self) {
                    return Ok(false);
                }
                let took = Instant::now();
                let step = job
                    .live
                    .commit_extents(into, 0, base, &chunk)
                    .map_err(|e| format!("copying the guest's changes: {e}"))?;
                job.pace(step.copied, took, started);
            }
        }
        Ok(!job.cancelled(self))
    }

    /// The pivot of an active commit: with the queues quiesced, the last
    /// of the guest's changes copied and the base made the top
    /// ([`Live::pivot`]), the image lock with it; then the bitmaps move
    /// into it, as after a snapshot.
    fn pivot(
        &self,
        job: &Job,
        into: CommitBase,
        base: usize,
    ) -> Result<Vec<PathBuf>, crate::disk::SnapshotError> {
        let relock = |file: &std::fs::File| match &self.image_lock {
            Some(l) => l.relock(file),
            None => Ok(()),
        };
        let pivoted = self.mirror_end(|last| {
            let extents = last.map(|b| b.dirty_extents()).unwrap_or_default();
            let step = job.live.commit_extents(&into, 0, base, &extents)?;
            job.copied.fetch_add(step.copied, Ordering::Relaxed);
            job.live.pivot(into, base, relock)
        })?;
        self.bitmaps_follow_snapshot();
        Ok(pivoted)
    }
}

impl Job {
    /// Whether the job is to stop: cancelled, or the daemon stopping.
    fn cancelled(&self, device: &Device) -> bool {
        self.cancel.load(Ordering::Relaxed) || device.stopping()
    }

    /// After a stretch that copied `copied` bytes in the time since
    /// `took`: counts them and keeps to the speed (from `started`), or
    /// without one to a quarter of the time.
    fn pace(&self, copied: u64, took: Instant, started: Instant) {
        self.copied.fetch_add(copied, Ordering::Relaxed);
        if copied > 0 && self.speed == 0 {
            // Without a speed, a quarter of the time at most, the guest's
            // the rest: a stream's stretch holds the image's metadata
            // locks (which a waiter would not get back from a thread that
            // takes them again at once), and any stretch takes the disk
            // (its data and fdatasyncs). Measured with
            // scripts/bench-jobs.sh: at half the time the guest kept
            // 0.45-0.79 of its write IOPS.
            std::thread::sleep((3 * took.elapsed()).min(Duration::from_millis(500)));
        }
        if self.speed > 0 {
            // Copied bytes keep to the speed: sleep until the time they
            // are due.
            let due = Duration::from_secs_f64(
                self.copied.load(Ordering::Relaxed) as f64 / self.speed as f64,
            );
            let now = started.elapsed();
            if due > now {
                std::thread::sleep((due - now).min(Duration::from_secs(1)));
            }
        }
    }
}

/// `extents` (sorted, not overlapping) cut into runs of at most about
/// `max` bytes each (an extent longer than that is cut too).
fn stretches(extents: &[(u64, u64)], max: u64) -> Vec<Vec<(u64, u64)>> {
    let mut out: Vec<Vec<(u64, u64)>> = Vec::new();
    let mut bytes = max;
    for &(mut at, mut len) in extents {
        while len > 0 {
            if bytes >= max {
                out.push(Vec::new());
                bytes = 0;
            }
            let n = len.min(max - bytes);
            if let Some(v) = out.last_mut() {
                v.push((at, n));
            }
            bytes += n;
            at += n;
            len -= n;
        }
    }
    out
}

/// What a job does between its checks and its switch.
enum Work {
    /// Copy up into the top.
    Stream,
    /// Copy down from layer `.0` (and those below it, above the base)
    /// into the base, through the base's own handle.
    Commit(usize, CommitBase),
    /// An active commit: copy the active layer (and those below it, above
    /// the base) into the base while tracking the guest's writes, then
    /// pivot to the base.
    Active(CommitBase),
}

impl Work {
    fn kind(&self) -> &'static str {
        match self {
            Work::Stream => "stream",
            Work::Commit(..) | Work::Active(_) => "commit",
        }
    }
}

/// The index of `wanted` in `chain` (top first), the path as the chain
/// lists it (`ctl status`; `ctl stream` finds it there for a path given
/// otherwise). The daemon looks nothing up by path: its sandbox allows
/// no such call after start-up.
fn find_in_chain(chain: &[PathBuf], wanted: &Path) -> Result<usize, JobError> {
    chain.iter().position(|p| p == wanted).ok_or_else(|| {
        JobError::Invalid(format!(
            "--base {}: not in the chain ({}; as `ctl status` lists it)",
            wanted.display(),
            chain
                .iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ))
    })
}
