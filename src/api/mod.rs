//! The daemon's HTTP endpoints, on tiny_http: the control API
//! (`--api PATH`, a Unix socket of mode 0600) and the read-only metrics
//! endpoint (`--metrics ADDR`, TCP or Unix).
//!
//! Both serve the same table of verbs ([`VERBS`]); the metrics endpoint
//! has no [`Control`], so a verb that needs one is not found there: no
//! control verb is reachable over `--metrics`, over TCP in particular.
//! Adding a verb is one function and one line in the table.
//!
//! tiny_http accepts on a thread of its own and reads each connection on
//! a small pool of threads; requests are answered one at a time on the
//! endpoint's own thread, which never touches the queue workers: it loads
//! their counters and the capacity, and a resize stores the capacity.
//! Under the daemon's seccomp filter it needs accept4, recvfrom/sendto,
//! clone3 and futex for the pool's threads, and getpeername (tiny_http
//! asks each connection for its peer), all on the filter's list.
//!
//! What tiny_http does not bound: a connection that stays open and idle
//! holds one of the pool's threads until its client closes it, and an
//! accept error (the daemon out of fds) ends the endpoint (logged).

mod control;
pub mod ctl;

use std::io::{self, Read};
use std::net::TcpListener;
use std::os::unix::net::UnixListener;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;

use serde::Deserialize;
use tiny_http::{Header, Method, Request, Response, Server};

use ringblk_metrics::prometheus;
use ringblk_metrics::transport::MetricsAddr;
use ringblk_metrics::{MetricsDoc, MetricsError, QueueMetrics};

use crate::device::{ResizeError, Resized};
pub use control::{Control, Status};

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
    method: &'a Method,
    queues: &'a [Arc<QueueMetrics>],
    control: Option<&'a Control>,
    body: &'a [u8],
}

impl Ctx<'_> {
    fn snapshot(&self) -> MetricsDoc {
        MetricsDoc {
            queues: self.queues.iter().map(|q| q.snapshot()).collect(),
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

/// One verb: a method (or two), a path, and whether it needs the control
/// side (then it exists on `--api` only).
pub struct Verb {
    methods: &'static [Method],
    path: &'static str,
    control: bool,
    run: fn(&Ctx<'_>) -> Reply,
}

/// Every verb, on every endpoint that has what it needs.
pub const VERBS: &[Verb] = &[
    Verb {
        methods: &[Method::Get],
        path: "/metrics",
        control: false,
        run: metrics_text,
    },
    Verb {
        methods: &[Method::Get],
        path: "/metrics.json",
        control: false,
        run: metrics_json,
    },
    Verb {
        methods: &[Method::Get],
        path: "/api/v1/status",
        control: true,
        run: status,
    },
    Verb {
        methods: &[Method::Put, Method::Post],
        path: "/api/v1/resize",
        control: true,
        run: resize,
    },
    Verb {
        methods: &[Method::Get, Method::Put, Method::Post],
        path: "/api/v1/qos",
        control: true,
        run: qos,
    },
];

fn metrics_text(ctx: &Ctx<'_>) -> Reply {
    Reply {
        status: 200,
        content_type: prometheus::CONTENT_TYPE,
        body: prometheus::encode(&ctx.snapshot().queues),
    }
}

fn metrics_json(ctx: &Ctx<'_>) -> Reply {
    match serde_json::to_string(&ctx.snapshot()) {
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
                ResizeError::Shrink { .. } => 409,
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

/// GET /api/v1/qos: the limits. PUT (or POST) with a JSON object of
/// limits by their JSON names (`QosChanges`): those change, the others
/// stay (0 removes a limit);
/// the answer is the limits now in force.
fn qos(ctx: &Ctx<'_>) -> Reply {
    let run = || -> Result<crate::qos::QosLimits, Reply> {
        let c = control(ctx)?;
        if *ctx.method == Method::Get {
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

/// The answer to `method path` with `body`, on an endpoint with or
/// without the control side.
pub fn dispatch(
    method: &Method,
    url: &str,
    body: &[u8],
    queues: &[Arc<QueueMetrics>],
    control: Option<&Control>,
) -> Reply {
    let path = url.split('?').next().unwrap_or_default();
    let here = |v: &&Verb| !v.control || control.is_some();
    let Some(verb) = VERBS.iter().filter(here).find(|v| v.path == path) else {
        let known: Vec<String> = VERBS
            .iter()
            .filter(here)
            .map(|v| {
                let m: Vec<&str> = v.methods.iter().map(Method::as_str).collect();
                format!("{} {}", m.join("|"), v.path)
            })
            .collect();
        return Reply::error(
            404,
            format!("unknown verb {path}; here: {}", known.join(", ")),
        );
    };
    if !verb.methods.contains(method) {
        let m: Vec<&str> = verb.methods.iter().map(Method::as_str).collect();
        return Reply::error(
            405,
            format!("{path} takes {}, not {method}", m.join(" or ")),
        );
    }
    (verb.run)(&Ctx {
        method,
        queues,
        control,
        body,
    })
}

/// A running endpoint. Dropping it (or [`Endpoint::shutdown`]) stops its
/// thread; the Unix socket file is removed.
pub struct Endpoint {
    addr: MetricsAddr,
    stop: Arc<AtomicBool>,
    server: Arc<Server>,
    thread: Option<JoinHandle<()>>,
}

/// Where an endpoint listens.
pub enum Bound {
    Tcp(TcpListener),
    Unix(UnixListener),
}

/// Binds `addr` for the read-only metrics endpoint (see
/// [`MetricsAddr::parse`]), before the seccomp filter: binding may probe
/// and replace a stale socket file.
///
/// A Unix socket path that exists but has no listener (left by a crashed
/// daemon) is replaced; one with a live listener is `AddrInUse`; anything
/// else at that path is left alone and is an error. A TCP address that is
/// not loopback is allowed (Prometheus usually scrapes from another host)
/// but logged as a warning, since the counters reveal the guest's I/O
/// pattern.
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
                Bound::Unix(UnixListener::bind(path).map_err(bind_err)?),
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
pub fn spawn_metrics(addr: &str, queues: Vec<Arc<QueueMetrics>>) -> Result<Endpoint, MetricsError> {
    let (bound, addr) = bind_metrics(addr)?;
    let endpoint = spawn(bound, addr, queues, None)?;
    log::info!(
        "metrics on {} (GET /metrics, /metrics.json)",
        endpoint.local_addr()
    );
    Ok(endpoint)
}

/// Serves `bound` (known as `addr`) on a thread of its own: the counters
/// of `queues`, and with `control` the control verbs too.
pub fn spawn(
    bound: Bound,
    addr: MetricsAddr,
    queues: Vec<Arc<QueueMetrics>>,
    control: Option<Arc<Control>>,
) -> Result<Endpoint, MetricsError> {
    let err = |e: Box<dyn std::error::Error + Send + Sync>| MetricsError::Bind {
        addr: addr.to_string(),
        source: io::Error::other(e.to_string()),
    };
    let server = Arc::new(
        match bound {
            Bound::Tcp(l) => Server::from_listener(l, None),
            Bound::Unix(l) => Server::from_listener(l, None),
        }
        .map_err(err)?,
    );
    let stop = Arc::new(AtomicBool::new(false));
    let name = if control.is_some() { "api" } else { "metrics" };
    let thread = {
        let (server, stop) = (server.clone(), stop.clone());
        std::thread::Builder::new()
            .name(name.into())
            .spawn(move || serve(&server, &queues, control.as_deref(), &stop))
            .map_err(|e| MetricsError::Bind {
                addr: addr.to_string(),
                source: e,
            })?
    };
    Ok(Endpoint {
        addr,
        stop,
        server,
        thread: Some(thread),
    })
}

fn serve(
    server: &Server,
    queues: &[Arc<QueueMetrics>],
    control: Option<&Control>,
    stop: &AtomicBool,
) {
    loop {
        let rq = server.recv();
        if stop.load(Ordering::Relaxed) {
            return;
        }
        match rq {
            Ok(rq) => answer(rq, queues, control),
            Err(e) => {
                // tiny_http's accept thread ends on an accept error.
                log::error!("HTTP endpoint stopped: {e}");
                return;
            }
        }
    }
}

/// Reads the body (at most [`MAX_BODY`]) and answers one request.
fn answer(mut rq: Request, queues: &[Arc<QueueMetrics>], control: Option<&Control>) {
    let reply = match read_body(&mut rq) {
        Ok(body) => dispatch(rq.method(), rq.url(), &body, queues, control),
        Err(r) => r,
    };
    let header = Header::from_bytes(&b"Content-Type"[..], reply.content_type.as_bytes());
    let mut response = Response::from_string(reply.body).with_status_code(reply.status);
    if let Ok(h) = header {
        response = response.with_header(h);
    }
    if let Err(e) = rq.respond(response) {
        log::debug!("HTTP answer: {e}");
    }
}

fn read_body(rq: &mut Request) -> Result<Vec<u8>, Reply> {
    let too_large = || Reply::error(413, format!("request body over {MAX_BODY} bytes"));
    if rq.body_length().is_some_and(|n| n > MAX_BODY) {
        return Err(too_large());
    }
    let mut body = Vec::new();
    rq.as_reader()
        .take(MAX_BODY as u64 + 1)
        .read_to_end(&mut body)
        .map_err(|e| Reply::error(400, format!("reading the body: {e}")))?;
    if body.len() > MAX_BODY {
        return Err(too_large());
    }
    Ok(body)
}

impl Endpoint {
    /// The bound address; for TCP with port 0, the port actually chosen.
    pub fn local_addr(&self) -> String {
        self.addr.to_string()
    }

    /// Stops the thread and waits for it.
    pub fn shutdown(mut self) {
        self.stop_thread();
    }

    fn stop_thread(&mut self) {
        let Some(thread) = self.thread.take() else {
            return;
        };
        self.stop.store(true, Ordering::Relaxed);
        self.server.unblock();
        let _ = thread.join();
        // The server itself (its accept thread) stops when the last Arc
        // goes, which removes a Unix socket file.
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        self.stop_thread();
    }
}

#[cfg(test)]
mod tests;
