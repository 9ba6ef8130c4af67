//! The HTTP/1 server under both endpoints: hyper's, on a tokio
//! current-thread runtime of the endpoint's own, with every resource a
//! client can make it spend bounded.
//!
//! - Threads: the endpoint's one thread runs every connection; a verb the
//!   table marks `slow` (resize: image I/O, librbd, the front-end's
//!   back-end channel) runs on a blocking pool of at most [`VERB_THREADS`]
//!   threads, started on demand and gone when idle, so that the fast
//!   verbs (status, qos, the counters) are answered while one waits.
//! - Connections: at most [`MAX_CONNECTIONS`] at once, one fd each; past
//!   that a new one is closed as soon as it is accepted.
//! - Sizes: the request line and headers at most [`MAX_HEAD`] bytes (431
//!   past that, which is also all the reading buffer holds); a body at
//!   most [`MAX_BODY`] (413: a declared `Content-Length` over it is
//!   refused before a byte of it is read, a chunked one when it passes
//!   it); a GET's body is refused the same way, unread.
//! - Time: the request (head and body) must arrive within
//!   [`REQUEST_DEADLINE`] of the accept, and the answer must be taken
//!   within [`ANSWER_DEADLINE`] of its being ready; past either the
//!   connection is closed. The verb's own time is not counted (a resize
//!   has a deadline of its own for the front-end).
//! - One request per connection (no keep-alive): pipelined requests after
//!   the first are never read.
//! - Accept errors (out of fds, ECONNABORTED, ENOBUFS, ENOMEM) are logged
//!   at a limited rate, and accepting goes on after [`ACCEPT_BACKOFF`].
//!
//! The fds an endpoint can hold are so bounded by [`ENDPOINT_FDS`]; what
//! the fd limit leaves beyond that is the vhost-user side's (see
//! `daemon::fds`).
//!
//! Under the seccomp filter this needs what the daemon already allows:
//! accept4, recvfrom and write on the connections (hyper is told not to
//! use writev), epoll_wait and an eventfd for the runtime, futex, and
//! clone3 and the rest of a thread's start and exit for the verb pool.
//! The runtime, its epoll and eventfd, and the listener's registration are
//! made at start-up, before the filter.

use std::convert::Infallible;
use std::io;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, LengthLimitError, Limited};
use hyper::body::{Body, Incoming};
use hyper::header::{CONTENT_TYPE, HeaderValue};
use hyper::server::conn::http1;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore, oneshot};
use tokio::time::Instant;

use super::{Api, MAX_BODY, Reply};
use crate::metrics::RateLimiter;
use crate::warn_limited;

/// Connections an endpoint serves at once; one more is closed at once.
pub const MAX_CONNECTIONS: usize = 64;

/// The request line and headers, at most (431 past it).
pub const MAX_HEAD: usize = 8 << 10;

/// From the accept until the whole request (head and body) is in.
pub const REQUEST_DEADLINE: Duration = Duration::from_secs(5);

/// From the answer's being ready until the client has taken it.
pub const ANSWER_DEADLINE: Duration = Duration::from_secs(5);

/// Threads that run slow verbs (one resize at a time runs; a second waits
/// for it); started when needed, they exit after 10 s idle.
pub const VERB_THREADS: usize = 2;

/// The most fds one endpoint holds: its connections, one more being
/// closed past the cap, the listener, and the runtime's epoll and eventfd.
pub const ENDPOINT_FDS: usize = MAX_CONNECTIONS + 4;

/// How long accepting pauses after an error.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// Where an endpoint listens (bound before the seccomp filter).
pub enum Bound {
    Tcp(std::net::TcpListener),
    Unix(std::os::unix::net::UnixListener),
}

/// A running endpoint's thread; dropping it stops the thread.
pub struct Server {
    stop: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl Server {
    /// Serves `api` on `bound`, on a thread named `name`.
    pub fn spawn(name: &'static str, bound: Bound, api: Api) -> io::Result<Server> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .enable_time()
            .max_blocking_threads(VERB_THREADS)
            .thread_name(format!("{name}-verb"))
            .build()?;
        let listener = {
            // Registering with the runtime's epoll needs its context.
            let _in = rt.enter();
            match bound {
                Bound::Tcp(l) => {
                    l.set_nonblocking(true)?;
                    Listener::Tcp(tokio::net::TcpListener::from_std(l)?)
                }
                Bound::Unix(l) => {
                    l.set_nonblocking(true)?;
                    Listener::Unix(tokio::net::UnixListener::from_std(l)?)
                }
            }
        };
        let (stop, stopped) = oneshot::channel::<()>();
        let api = Arc::new(api);
        let thread = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || {
                rt.block_on(async move {
                    tokio::select! {
                        _ = stopped => {}
                        () = accept(name, listener, api) => {}
                    }
                });
                // Open connections are closed; a verb on the pool gets a
                // moment to finish.
                rt.shutdown_timeout(Duration::from_secs(1));
            })?;
        Ok(Server {
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// Stops the thread and waits for it.
    pub fn stop(&mut self) {
        drop(self.stop.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop();
    }
}

enum Listener {
    Tcp(tokio::net::TcpListener),
    Unix(tokio::net::UnixListener),
}

/// Accepts until the endpoint stops, each connection on a task of its own
/// within the cap.
async fn accept(name: &'static str, listener: Listener, api: Arc<Api>) {
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    let mut errors = RateLimiter::new(3, Duration::from_secs(60));
    let mut full = RateLimiter::new(3, Duration::from_secs(60));
    loop {
        let accepted = match &listener {
            Listener::Tcp(l) => l.accept().await.map(|(s, _)| Conn::Tcp(s)),
            Listener::Unix(l) => l.accept().await.map(|(s, _)| Conn::Unix(s)),
        };
        let conn = match accepted {
            Ok(c) => c,
            Err(e) => {
                // EMFILE and ENFILE last until fds are freed, ECONNABORTED
                // and the like concern one connection: either way the
                // endpoint goes on.
                warn_limited!(
                    errors,
                    "{name} endpoint: accept: {e}; trying again in {ACCEPT_BACKOFF:?}"
                );
                tokio::time::sleep(ACCEPT_BACKOFF).await;
                continue;
            }
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            warn_limited!(
                full,
                "{name} endpoint: {MAX_CONNECTIONS} connections open; closing a new one"
            );
            continue;
        };
        match conn {
            Conn::Tcp(s) => tokio::spawn(serve(TokioIo::new(s), api.clone(), slot)),
            Conn::Unix(s) => tokio::spawn(serve(TokioIo::new(s), api.clone(), slot)),
        };
    }
}

enum Conn {
    Tcp(tokio::net::TcpStream),
    Unix(tokio::net::UnixStream),
}

/// Serves one connection: one request, its answer, then close; or close
/// at the deadline. `_slot` is its place under the cap.
async fn serve<I>(io: I, api: Arc<Api>, _slot: OwnedSemaphorePermit)
where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let deadline = Arc::new(Deadline::new(Instant::now() + REQUEST_DEADLINE));
    let service = {
        let deadline = deadline.clone();
        hyper::service::service_fn(move |rq| answer(rq, api.clone(), deadline.clone()))
    };
    let conn = http1::Builder::new()
        .keep_alive(false)
        // The reading buffer, and so what a head may take: hyper answers
        // 431 when a head does not fit.
        .max_buf_size(MAX_HEAD)
        .max_header_size(MAX_HEAD)
        // write(2), not writev(2): one syscall fewer on the filter's list.
        .writev(false)
        .serve_connection(io, service);
    tokio::select! {
        r = conn => {
            if let Err(e) = r {
                log::debug!("HTTP connection: {e}");
            }
        }
        () = deadline.passed() => log::debug!("HTTP connection closed at its deadline"),
    }
}

/// The answer to one request; arms the deadline for writing it.
async fn answer(
    rq: Request<Incoming>,
    api: Arc<Api>,
    deadline: Arc<Deadline>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let reply = reply(rq, &api, &deadline).await;
    deadline.set(Some(Instant::now() + ANSWER_DEADLINE));
    let mut rsp = Response::new(Full::new(Bytes::from(reply.body)));
    *rsp.status_mut() =
        StatusCode::from_u16(reply.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    rsp.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(reply.content_type));
    Ok(rsp)
}

fn takes_body(method: &Method) -> bool {
    *method == Method::PUT || *method == Method::POST
}

async fn reply(rq: Request<Incoming>, api: &Arc<Api>, deadline: &Deadline) -> Reply {
    let (head, body) = rq.into_parts();
    let too_large = || Reply::error(413, format!("request body over {} KiB", MAX_BODY >> 10));
    // A declared length over the limit: refused before any of it is read.
    if body.size_hint().lower() > MAX_BODY as u64 {
        return too_large();
    }
    let verb = match api.route(&head.method, head.uri.path()) {
        Ok(v) => v,
        Err(r) => return r,
    };
    let body = if takes_body(&head.method) {
        match Limited::new(body, MAX_BODY).collect().await {
            Ok(b) => b.to_bytes(),
            Err(e) if e.is::<LengthLimitError>() => return too_large(),
            Err(e) => return Reply::error(400, format!("reading the body: {e}")),
        }
    } else if !body.is_end_stream() {
        return Reply::error(413, format!("{} {} takes no body", head.method, verb.path));
    } else {
        Bytes::new()
    };
    // The request is in; the verb's time is its own.
    deadline.set(None);
    if !verb.slow {
        return api.run(verb, &head.method, &body);
    }
    let (api, method) = (api.clone(), head.method.clone());
    tokio::task::spawn_blocking(move || api.run(verb, &method, &body))
        .await
        .unwrap_or_else(|e| Reply::error(500, format!("{} failed: {e}", verb.path)))
}

/// When a connection is closed, unless it is done first; `None` while a
/// verb runs.
struct Deadline {
    at: Mutex<Option<Instant>>,
    changed: Notify,
}

impl Deadline {
    fn new(at: Instant) -> Deadline {
        Deadline {
            at: Mutex::new(Some(at)),
            changed: Notify::new(),
        }
    }

    fn set(&self, at: Option<Instant>) {
        *self.at.lock().unwrap_or_else(|p| p.into_inner()) = at;
        // Stores a permit if `passed` is not waiting right now.
        self.changed.notify_one();
    }

    /// Returns once the deadline in force has passed.
    async fn passed(&self) {
        loop {
            let at = *self.at.lock().unwrap_or_else(|p| p.into_inner());
            match at {
                Some(at) => tokio::select! {
                    () = tokio::time::sleep_until(at) => return,
                    () = self.changed.notified() => {}
                },
                None => self.changed.notified().await,
            }
        }
    }
}
