//! The daemon's HTTP endpoints: the control API (`--api PATH`, a Unix
//! socket of mode 0600) and the read-only metrics endpoint (`--metrics
//! ADDR`, TCP or a Unix socket, also 0600).
//!
//! Both serve the same table of verbs ([`VERBS`]); the metrics endpoint
//! has no [`Control`], so a verb that needs one is not found there: no
//! control verb is reachable over `--metrics`, over TCP in particular.
//! Adding a verb is one function and one entry in the table; the table
//! also lists itself (`GET /api/v1/verbs`, `ringblk ctl verbs`), and the
//! daemon's log line for each endpoint and its 404 answers come from it.
//!
//! The server ([`server`]: hyper on a tokio current-thread runtime) bounds
//! what any client can make it spend: threads, connections, head and body
//! sizes, and time. The verbs never touch the queue workers: they load
//! their counters and the capacity, and a resize stores the capacity.

mod control;
mod server;

use std::net::TcpListener;
use std::sync::Arc;

use hyper::Method;
use serde::Deserialize;

use ringblk_metrics::prometheus;
use ringblk_metrics::transport::MetricsAddr;
use ringblk_metrics::{MetricsDoc, MetricsError, QueueMetrics};

pub use control::{Control, Identity, Status};
pub use server::{
    ANSWER_DEADLINE, Bound, ENDPOINT_FDS, MAX_CONNECTIONS, MAX_HEAD, REQUEST_DEADLINE, VERB_THREADS,
};

use crate::device::{Device, ResizeError, Resized};

/// The largest request body taken; a larger one gets 413.
pub const MAX_BODY: usize = 64 << 10;

/// Path prefix of the control verbs.
pub const API_PREFIX: &str = "/api/v1";

/// What a verb answers with.
pub struct Reply {
    status: u16,
    content_type: &'static str,
    body: String,
}

impl Reply {
    fn json(status: u16, value: &impl serde::Serialize) -> Reply {
        match serde_json::to_string_pretty(value) {
            Ok(mut body) => {
                body.push('\n');
                Reply {
                    status,
                    content_type: "application/json",
                    body,
                }
            }
            Err(e) => Reply::error(500, format!("encoding the answer: {e}")),
        }
    }

    /// `{"error": "..."}`: one line a client can print as it is.
    fn error(status: u16, msg: impl Into<String>) -> Reply {
        let body = serde_json::json!({ "error": msg.into() });
        Reply {
            status,
            content_type: "application/json",
            body: format!("{body}\n"),
        }
    }
}

/// What a verb sees.
pub struct Ctx<'a> {
    verbs: &'a [Verb],
    method: &'a Method,
    queues: &'a [Arc<QueueMetrics>],
    control: Option<&'a Control>,
    device: Option<&'a Device>,
    body: &'a [u8],
}

impl Ctx<'_> {
    fn snapshot(&self) -> MetricsDoc {
        MetricsDoc {
            queues: self.queues.iter().map(|q| q.snapshot()).collect(),
            job: None,
        }
    }

    /// The body as JSON of type `T`; an empty body is `{}`.
    fn json_body<T: serde::de::DeserializeOwned>(&self) -> Result<T, Reply> {
        self.json_body_or(|e| format!("malformed JSON body: {e}"))
    }

    /// The body as a `T`; JSON that is well formed but not a `T` (an
    /// unknown field, a value of the wrong type) is described by `data`.
    fn json_body_or<T: serde::de::DeserializeOwned>(
        &self,
        data: impl FnOnce(serde_json::Error) -> String,
    ) -> Result<T, Reply> {
        let body = if self.body.iter().all(u8::is_ascii_whitespace) {
            &b"{}"[..]
        } else {
            self.body
        };
        serde_json::from_slice(body).map_err(|e| match e.classify() {
            serde_json::error::Category::Data => Reply::error(400, data(e)),
            _ => Reply::error(400, format!("malformed JSON body: {e}")),
        })
    }
}

/// One verb: a method (or two), a path, whether it needs the control
/// side (then it exists on `--api` only), and whether it may block (then
/// it runs on the endpoint's verb threads, so that the others are
/// answered meanwhile). A GET takes no body; PUT and POST take JSON.
pub struct Verb {
    methods: &'static [Method],
    path: &'static str,
    control: bool,
    slow: bool,
    /// What it does, for `ringblk ctl verbs`.
    doc: &'static str,
    run: fn(&Ctx<'_>) -> Reply,
}

impl Verb {
    /// The methods it takes: GET, PUT, POST.
    pub fn methods(&self) -> Vec<&'static str> {
        self.methods.iter().map(Method::as_str).collect()
    }

    pub fn path(&self) -> &'static str {
        self.path
    }

    /// Whether it needs the control side (then it is on `--api` only).
    pub fn control(&self) -> bool {
        self.control
    }

    pub fn doc(&self) -> &'static str {
        self.doc
    }

    /// Whether an endpoint with (`control`) or without the control side
    /// serves it.
    fn served(&self, control: bool) -> bool {
        !self.control || control
    }

    /// `GET|PUT /api/v1/qos`.
    fn summary(&self) -> String {
        format!("{} {}", self.methods().join("|"), self.path)
    }
}

/// How [`VERBS`] lists itself: one entry per verb.
#[derive(serde::Serialize)]
struct VerbDoc {
    methods: Vec<&'static str>,
    path: &'static str,
    control: bool,
    doc: &'static str,
}

/// The verbs an endpoint with (`control`) or without the control side
/// serves, in one line: `GET /metrics, GET /metrics.json, ...`.
pub fn verb_list(control: bool) -> String {
    let here: Vec<String> = VERBS
        .iter()
        .filter(|v| v.served(control))
        .map(Verb::summary)
        .collect();
    here.join(", ")
}

/// Every verb, on every endpoint that has what it needs.
pub const VERBS: &[Verb] = &[
    Verb {
        methods: &[Method::GET],
        path: "/metrics",
        control: false,
        slow: false,
        doc: "The counters and latency histograms, in Prometheus's text format.",
        run: metrics_text,
    },
    Verb {
        methods: &[Method::GET],
        path: "/metrics.json",
        control: false,
        slow: false,
        doc: "The counters and latency histograms, as JSON (what `ringblk stats` reads).",
        run: metrics_json,
    },
    Verb {
        methods: &[Method::GET],
        path: "/api/v1/status",
        control: true,
        slow: false,
        doc: "The daemon and the device: version, uptime, socket, serial, image lock, size, queues, features, write cache, the front-end connected (its pid), QoS.",
        run: status,
    },
    Verb {
        methods: &[Method::GET],
        path: "/api/v1/verbs",
        control: false,
        slow: false,
        doc: "The verbs this endpoint serves: this list.",
        run: verbs,
    },
    Verb {
        methods: &[Method::PUT, Method::POST],
        path: "/api/v1/resize",
        control: true,
        // Image I/O (an RBD resize is a round trip to the cluster), and
        // telling the front-end, which may be slow to read.
        slow: true,
        doc: "Resize the disk the guest sees: {\"size\": BYTES or \"2G\", \"force\": bool} (no size: re-read the image's); shrinking needs force.",
        run: resize,
    },
    Verb {
        methods: &[Method::GET, Method::PUT, Method::POST],
        path: "/api/v1/qos",
        control: true,
        slow: false,
        doc: "The QoS limits (GET), or change those given (PUT, by their JSON names; 0 removes one).",
        run: qos,
    },
    Verb {
        methods: &[Method::GET],
        path: "/api/v1/bitmaps",
        control: true,
        slow: false,
        doc: "The dirty bitmaps: name, granularity, dirty bytes, consistent or not.",
        run: bitmap_list,
    },
    // The bitmap and backup verbs that change something hold the guest's
    // queues for a moment (`device::tracking`) and do file I/O.
    Verb {
        methods: &[Method::POST],
        path: "/api/v1/bitmaps/add",
        control: true,
        slow: true,
        doc: "Add a dirty bitmap: {\"name\": NAME, \"granularity\": BYTES or \"64K\" (optional)}; it records every change from now on.",
        run: bitmap_add,
    },
    Verb {
        methods: &[Method::POST],
        path: "/api/v1/bitmaps/remove",
        control: true,
        slow: true,
        doc: "Remove a dirty bitmap and its file: {\"name\": NAME}.",
        run: bitmap_remove,
    },
    Verb {
        methods: &[Method::GET],
        path: "/api/v1/backup",
        control: true,
        slow: false,
        doc: "The running backup, if any: its NBD socket, bitmap and copied clusters.",
        run: backup_status,
    },
    Verb {
        methods: &[Method::POST],
        path: "/api/v1/backup/start",
        control: true,
        slow: true,
        doc: "Export the disk as it is at this instant, read-only over NBD: {\"nbd\": SOCKET, \"bitmap\": NAME (optional)}.",
        run: backup_start,
    },
    Verb {
        methods: &[Method::POST],
        path: "/api/v1/backup/stop",
        control: true,
        slow: true,
        doc: "End the backup export: {\"failed\": bool}; without it the exported changes leave the bitmap (the backup succeeded); failed keeps them in it.",
        run: backup_stop,
    },
    Verb {
        methods: &[Method::PUT, Method::POST],
        path: "/api/v1/snapshot",
        control: true,
        // It waits for the requests in flight, and formats and syncs the
        // overlay.
        slow: true,
        doc: "Take a live external snapshot of a qcow2 image: {\"overlay\": NAME or a path in --snapshot-dir}; the new overlay becomes the top of the chain.",
        run: snapshot,
    },
    Verb {
        methods: &[Method::PUT, Method::POST],
        path: "/api/v1/stream",
        control: true,
        slow: false,
        doc: "Start a stream job: {\"base\": a layer of the chain as status lists it (optional: none, the top then stands alone), \"speed\": bytes per second (optional)}; the layers between the top and the base are copied into the top, then drop out of the chain.",
        run: stream,
    },
    Verb {
        methods: &[Method::PUT, Method::POST],
        path: "/api/v1/commit",
        control: true,
        // It opens the base for writing.
        slow: true,
        doc: "Start a commit job: {\"top\": a layer of the chain, as status lists it (the top itself: an active commit, which pivots to the base), \"base\": a layer below it (optional: its backing file), \"speed\": bytes per second (optional)}; the layers from top down to the base are copied into the base, then drop out of the chain.",
        run: commit,
    },
    Verb {
        methods: &[Method::GET],
        path: "/api/v1/job",
        control: true,
        slow: false,
        doc: "The block job running or last run: kind, state, bytes done of total, speed, the chain, the files it no longer uses.",
        run: job_status,
    },
    Verb {
        methods: &[Method::POST],
        path: "/api/v1/job/cancel",
        control: true,
        // It waits for the job to see the cancel.
        slow: true,
        doc: "Cancel the running block job; the chain stays as it was.",
        run: job_cancel,
    },
];

fn metrics_text(ctx: &Ctx<'_>) -> Reply {
    let mut body = prometheus::encode(&ctx.snapshot().queues);
    if let Some(job) = ctx.device.and_then(Device::job) {
        job_metrics(&mut body, &job);
    }
    Reply {
        status: 200,
        content_type: prometheus::CONTENT_TYPE,
        body,
    }
}

/// The block job's progress (the one running, or the last one), as
/// gauges labelled with its kind.
fn job_metrics(out: &mut String, job: &crate::device::JobInfo) {
    use std::fmt::Write;
    let running = u64::from(job.state == crate::device::JobState::Running);
    for (name, help, value) in [
        (
            "job_running",
            "Whether the block job runs (1) or ended (0).",
            running,
        ),
        (
            "job_done_bytes",
            "Guest bytes the block job has gone through.",
            job.done,
        ),
        (
            "job_total_bytes",
            "Guest bytes the block job goes through in all.",
            job.total,
        ),
        (
            "job_copied_bytes",
            "Bytes the block job has copied.",
            job.copied,
        ),
        (
            "job_speed_bytes",
            "The block job's speed limit in bytes per second (0: none).",
            job.speed,
        ),
        (
            "job_remaining_bytes",
            "An active commit: bytes the guest changed since its last pass, still to copy (0 for other jobs).",
            job.remaining.unwrap_or(0),
        ),
    ] {
        // Writing to a String cannot fail.
        let _ = writeln!(out, "# HELP ringblk_{name} {help}");
        let _ = writeln!(out, "# TYPE ringblk_{name} gauge");
        let _ = writeln!(out, "ringblk_{name}{{kind=\"{}\"}} {value}", job.kind);
    }
}

fn metrics_json(ctx: &Ctx<'_>) -> Reply {
    let mut doc = ctx.snapshot();
    doc.job = ctx
        .device
        .and_then(Device::job)
        .and_then(|j| serde_json::to_value(j).ok());
    match serde_json::to_string(&doc) {
        Ok(body) => Reply {
            status: 200,
            content_type: "application/json",
            body,
        },
        Err(e) => Reply::error(500, format!("encoding the counters: {e}")),
    }
}

/// The control side; the table only routes a control verb where there is
/// one, so this is a bug's answer, not a client's.
fn control<'a>(ctx: &Ctx<'a>) -> Result<&'a Control, Reply> {
    ctx.control
        .ok_or_else(|| Reply::error(500, "no control API here"))
}

/// The verbs served here, from the table.
fn verbs(ctx: &Ctx<'_>) -> Reply {
    let here: Vec<VerbDoc> = ctx
        .verbs
        .iter()
        .filter(|v| v.served(ctx.control.is_some()))
        .map(|v| VerbDoc {
            methods: v.methods(),
            path: v.path,
            control: v.control,
            doc: v.doc,
        })
        .collect();
    Reply::json(200, &here)
}

fn status(ctx: &Ctx<'_>) -> Reply {
    match control(ctx) {
        Ok(c) => Reply::json(200, &c.status()),
        Err(r) => r,
    }
}

/// PUT /api/v1/resize body. `size` in bytes, or a string with a suffix
/// ("2G"); absent: re-read the image's size.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ResizeBody {
    size: Option<SizeValue>,
    #[serde(default)]
    force: bool,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum SizeValue {
    Bytes(u64),
    Text(String),
}

fn resize(ctx: &Ctx<'_>) -> Reply {
    let run = || -> Result<Resized, Reply> {
        let c = control(ctx)?;
        let body: ResizeBody = ctx.json_body()?;
        let size = match body.size {
            None => None,
            Some(SizeValue::Bytes(n)) => Some(n),
            Some(SizeValue::Text(s)) => Some(
                ringblk_metrics::parse_size(&s)
                    .map_err(|e| Reply::error(400, format!("bad size: {e}")))?,
            ),
        };
        c.resize(size, body.force).map_err(|e| {
            let status = match &e {
                e if e.is_internal() => 500,
                ResizeError::Tracking(e) => e.status(),
                ResizeError::Shrink { .. } | ResizeError::NotHeld(_) | ResizeError::Job(_) => 409,
                _ => 400,
            };
            Reply::error(status, e.to_string())
        })
    };
    match run() {
        Ok(r) => Reply::json(200, &r),
        Err(r) => r,
    }
}

/// PUT /api/v1/snapshot body: the new overlay, a file name in the
/// daemon's snapshot directory (or a path there).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SnapshotBody {
    overlay: std::path::PathBuf,
}

/// A live external snapshot: the overlay becomes the top of the chain.
fn snapshot(ctx: &Ctx<'_>) -> Reply {
    let run = || -> Result<crate::device::Snapshot, Reply> {
        let c = control(ctx)?;
        let body: SnapshotBody = ctx.json_body()?;
        c.snapshot(&body.overlay).map_err(|e| {
            use crate::disk::SnapshotError as E;
            let status = match &e {
                E::NoDirectory | E::NotQcow2 | E::Name(..) | E::ReadOnly => 400,
                E::Create { source, .. } if source.kind() == std::io::ErrorKind::AlreadyExists => {
                    409
                }
                E::Busy(_) | E::Lock(_) | E::Refused(_) => 409,
                E::Create { .. } | E::Format(_) => 500,
            };
            Reply::error(status, e.to_string())
        })
    };
    match run() {
        Ok(r) => Reply::json(200, &r),
        Err(r) => r,
    }
}

/// PUT /api/v1/stream body.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct StreamBody {
    #[serde(default)]
    base: Option<std::path::PathBuf>,
    #[serde(default)]
    speed: Option<u64>,
}

fn job_error(e: crate::device::JobError) -> Reply {
    use crate::device::JobError as E;
    let status = match &e {
        E::Invalid(_) => 400,
        E::Conflict(_) => 409,
        E::NoJob => 404,
        E::Io(_) => 500,
    };
    Reply::error(status, e.to_string())
}

/// Starts a stream job.
fn stream(ctx: &Ctx<'_>) -> Reply {
    let run = || -> Result<crate::device::JobInfo, Reply> {
        let c = control(ctx)?;
        let body: StreamBody = ctx.json_body()?;
        c.stream(body.base.as_deref(), body.speed)
            .map_err(job_error)
    };
    match run() {
        Ok(r) => Reply::json(200, &r),
        Err(r) => r,
    }
}

/// PUT /api/v1/commit body.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CommitBody {
    top: std::path::PathBuf,
    #[serde(default)]
    base: Option<std::path::PathBuf>,
    #[serde(default)]
    speed: Option<u64>,
}

/// Starts a commit job.
fn commit(ctx: &Ctx<'_>) -> Reply {
    let run = || -> Result<crate::device::JobInfo, Reply> {
        let c = control(ctx)?;
        let body: CommitBody = ctx.json_body()?;
        c.commit(&body.top, body.base.as_deref(), body.speed)
            .map_err(job_error)
    };
    match run() {
        Ok(r) => Reply::json(200, &r),
        Err(r) => r,
    }
}

/// The block job running or last run.
fn job_status(ctx: &Ctx<'_>) -> Reply {
    match control(ctx).and_then(|c| {
        c.job()
            .ok_or_else(|| job_error(crate::device::JobError::NoJob))
    }) {
        Ok(r) => Reply::json(200, &r),
        Err(r) => r,
    }
}

/// Cancels the running block job.
fn job_cancel(ctx: &Ctx<'_>) -> Reply {
    match control(ctx).and_then(|c| c.job_cancel().map_err(job_error)) {
        Ok(r) => Reply::json(200, &r),
        Err(r) => r,
    }
}

/// GET /api/v1/qos: the limits. PUT (or POST) with a JSON object of
/// limits by their JSON names (`QosChanges`): those change, the others
/// stay (0 removes a limit);
/// the answer is the limits now in force.
fn qos(ctx: &Ctx<'_>) -> Reply {
    let run = || -> Result<crate::qos::QosLimits, Reply> {
        let c = control(ctx)?;
        if *ctx.method == Method::GET {
            return Ok(c.qos());
        }
        let changes: crate::qos::QosChanges =
            ctx.json_body_or(|e| format!("QoS: {}", crate::qos::QosError::from_json(e)))?;
        c.set_qos(&changes)
            .map_err(|e| Reply::error(400, format!("QoS: {e}")))
    };
    match run() {
        Ok(l) => Reply::json(200, &l),
        Err(r) => r,
    }
}

/// A verb's answer, or its error as `{"error": ...}` with the status the
/// error calls for.
fn answer<T: serde::Serialize>(r: Result<T, Reply>) -> Reply {
    match r {
        Ok(v) => Reply::json(200, &v),
        Err(r) => r,
    }
}

fn tracking_error(e: crate::device::TrackingError) -> Reply {
    Reply::error(e.status(), e.to_string())
}

/// GET /api/v1/bitmaps: every bitmap (name, granularity, dirty bytes,
/// consistent).
fn bitmap_list(ctx: &Ctx<'_>) -> Reply {
    answer(control(ctx).map(|c| c.bitmaps()))
}

/// POST /api/v1/bitmaps/add body: `name`, and `granularity` in bytes or
/// with a suffix ("64K"; default 64 KiB).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct BitmapAddBody {
    name: String,
    granularity: Option<SizeValue>,
}

fn size_value(v: SizeValue, what: &str) -> Result<u64, Reply> {
    match v {
        SizeValue::Bytes(n) => Ok(n),
        SizeValue::Text(s) => ringblk_metrics::parse_size(&s)
            .map_err(|e| Reply::error(400, format!("bad {what}: {e}"))),
    }
}

fn bitmap_add(ctx: &Ctx<'_>) -> Reply {
    answer((|| {
        let c = control(ctx)?;
        let body: BitmapAddBody = ctx.json_body()?;
        let granularity = match body.granularity {
            Some(v) => size_value(v, "granularity")?,
            None => crate::bitmap::DEFAULT_GRANULARITY,
        };
        c.bitmap_add(&body.name, granularity)
            .map_err(tracking_error)
    })())
}

/// POST /api/v1/bitmaps/remove body: `name`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct BitmapRemoveBody {
    name: String,
}

fn bitmap_remove(ctx: &Ctx<'_>) -> Reply {
    answer((|| {
        let c = control(ctx)?;
        let body: BitmapRemoveBody = ctx.json_body()?;
        c.bitmap_remove(&body.name).map_err(tracking_error)?;
        Ok(serde_json::json!({ "removed": body.name }))
    })())
}

/// GET /api/v1/backup: the running backup, or `null`.
fn backup_status(ctx: &Ctx<'_>) -> Reply {
    answer(control(ctx).map(|c| c.backup()))
}

/// POST /api/v1/backup/start body: `nbd` (the socket: a name in the
/// daemon's --backup-dir, or a path there), and `bitmap`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct BackupStartBody {
    nbd: std::path::PathBuf,
    bitmap: Option<String>,
}

fn backup_start(ctx: &Ctx<'_>) -> Reply {
    answer((|| {
        let c = control(ctx)?;
        let body: BackupStartBody = ctx.json_body()?;
        c.backup_start(&body.nbd, body.bitmap.as_deref())
            .map_err(tracking_error)
    })())
}

/// POST /api/v1/backup/stop body: `failed` (default false): the backup
/// failed, and its bitmap keeps the changes it exported.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct BackupStopBody {
    #[serde(default)]
    failed: bool,
}

fn backup_stop(ctx: &Ctx<'_>) -> Reply {
    answer((|| {
        let c = control(ctx)?;
        let body: BackupStopBody = ctx.json_body()?;
        c.backup_stop(body.failed).map_err(tracking_error)
    })())
}

/// What an endpoint serves: the counters of `queues`, and with `control`
/// the control verbs too, from a table of `verbs` ([`VERBS`]).
pub struct Api {
    verbs: &'static [Verb],
    queues: Vec<Arc<QueueMetrics>>,
    control: Option<Arc<Control>>,
    /// The device, for what `/metrics` shows of it beside the queues' counters
    /// (a block job's progress).
    device: Option<Arc<Device>>,
}

impl Api {
    pub fn new(
        queues: Vec<Arc<QueueMetrics>>,
        control: Option<Arc<Control>>,
        device: Option<Arc<Device>>,
    ) -> Api {
        Api {
            verbs: VERBS,
            queues,
            control,
            device,
        }
    }

    /// The verb `method path` names here, or the answer (404, 405) that it
    /// names none.
    fn route(&self, method: &Method, path: &str) -> Result<&'static Verb, Reply> {
        let here = |v: &&Verb| v.served(self.control.is_some());
        let Some(verb) = self.verbs.iter().filter(here).find(|v| v.path == path) else {
            let known: Vec<String> = self.verbs.iter().filter(here).map(Verb::summary).collect();
            return Err(Reply::error(
                404,
                format!("unknown verb {path}; here: {}", known.join(", ")),
            ));
        };
        if !verb.methods.contains(method) {
            let m: Vec<&str> = verb.methods.iter().map(Method::as_str).collect();
            return Err(Reply::error(
                405,
                format!("{path} takes {}, not {method}", m.join(" or ")),
            ));
        }
        Ok(verb)
    }

    /// Runs `verb` (found by [`Api::route`]) on `body`.
    fn run(&self, verb: &Verb, method: &Method, body: &[u8]) -> Reply {
        (verb.run)(&Ctx {
            verbs: self.verbs,
            method,
            queues: &self.queues,
            control: self.control.as_deref(),
            device: self.device.as_deref(),
            body,
        })
    }

    /// The answer to `method url` with `body` (a query string is ignored).
    #[cfg(test)]
    fn dispatch(&self, method: &Method, url: &str, body: &[u8]) -> Reply {
        let path = url.split('?').next().unwrap_or_default();
        match self.route(method, path) {
            Ok(verb) => self.run(verb, method, body),
            Err(r) => r,
        }
    }
}

/// A running endpoint. Dropping it (or [`Endpoint::shutdown`]) stops its
/// thread.
pub struct Endpoint {
    addr: MetricsAddr,
    server: server::Server,
}

/// Binds `addr` for the read-only metrics endpoint (see
/// [`MetricsAddr::parse`]), before the seccomp filter: binding may probe
/// and replace a stale socket file.
///
/// A Unix socket path that exists but has no listener (left by a crashed
/// daemon) is replaced; one with a live listener is `AddrInUse`; anything
/// else at that path is left alone and is an error. A new socket file is
/// born with mode 0600, whatever the umask, like `--api`'s: the counters
/// reveal the guest's I/O pattern. A TCP address that is not loopback is
/// allowed (Prometheus usually scrapes from another host) but logged as a
/// warning, for the same reason.
pub fn bind_metrics(addr: &str) -> Result<(Bound, MetricsAddr), MetricsError> {
    let parsed = MetricsAddr::parse(addr);
    let bind_err = |source| MetricsError::Bind {
        addr: addr.to_string(),
        source,
    };
    match &parsed {
        MetricsAddr::Unix(path) => {
            crate::unix_socket::remove_stale(path).map_err(bind_err)?;
            Ok((
                Bound::Unix(crate::unix_socket::bind_with_mode(path, 0o600).map_err(bind_err)?),
                parsed.clone(),
            ))
        }
        MetricsAddr::Tcp(a) => {
            let l = TcpListener::bind(a).map_err(bind_err)?;
            let local = l.local_addr().map_err(bind_err)?;
            if !local.ip().is_loopback() {
                log::warn!("metrics endpoint on {local} is reachable from other hosts");
            }
            Ok((Bound::Tcp(l), MetricsAddr::Tcp(local.to_string())))
        }
    }
}

/// The read-only metrics endpoint on `addr`.
pub fn spawn_metrics(
    addr: &str,
    queues: Vec<Arc<QueueMetrics>>,
    device: Option<Arc<Device>>,
) -> Result<Endpoint, MetricsError> {
    let (bound, addr) = bind_metrics(addr)?;
    let endpoint = spawn(bound, addr, queues, None, device)?;
    log::info!(
        "metrics on {} ({})",
        endpoint.local_addr(),
        verb_list(false)
    );
    Ok(endpoint)
}

/// Serves `bound` (known as `addr`) on a thread of its own: the counters
/// of `queues` (and of `device`, where given), and with `control` the
/// control verbs too.
pub fn spawn(
    bound: Bound,
    addr: MetricsAddr,
    queues: Vec<Arc<QueueMetrics>>,
    control: Option<Arc<Control>>,
    device: Option<Arc<Device>>,
) -> Result<Endpoint, MetricsError> {
    let name = if control.is_some() { "api" } else { "metrics" };
    let api = Api::new(queues, control, device);
    let server = server::Server::spawn(name, bound, api).map_err(|e| MetricsError::Bind {
        addr: addr.to_string(),
        source: e,
    })?;
    Ok(Endpoint { addr, server })
}

impl Endpoint {
    /// The bound address; for TCP with port 0, the port actually chosen.
    pub fn local_addr(&self) -> String {
        self.addr.to_string()
    }

    /// Stops the thread, waits for it, and removes a Unix socket file.
    /// (Not on drop: the daemon never drops its endpoints before it exits,
    /// and removes its socket files by directory fd, the only way its
    /// seccomp filter allows.)
    pub fn shutdown(mut self) {
        self.server.stop();
        if let MetricsAddr::Unix(path) = &self.addr {
            let _ = std::fs::remove_file(path);
        }
    }
}

#[cfg(test)]
mod tests;
