//! The opt-in metrics endpoint: one thread, a minimal HTTP/1.0 responder.
//!
//! Paths: `GET /metrics` (Prometheus text), `GET /metrics.json` (the
//! snapshots, what `ringblk stats` and `ringblk bench` read).
//!
//! One thread serving one connection at a time is enough for a scraper every
//! few seconds, and it never touches the queue workers: it only loads their
//! atomics. Each connection gets [`IO_TIMEOUT`] in all, so a stuck client
//! delays the next scrape, never blocks the endpoint forever.
//!
//! It runs under the daemon's seccomp filter, so after start-up it uses only
//! allowed syscalls: accept4, recvfrom/sendto, ioctl(FIONBIO), epoll (for
//! the timeouts, instead of setsockopt), shutdown (to stop), close, unlink.

use std::io::{self, Read, Write};
use std::net::TcpListener;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixListener;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ringblk_metrics::prometheus;
use ringblk_metrics::transport::{MetricsAddr, Stream};
use ringblk_metrics::{MetricsDoc, MetricsError, QueueMetrics};

/// Time a connection gets to send its request and take the answer.
pub const IO_TIMEOUT: Duration = Duration::from_secs(2);

enum Listener {
    Tcp(TcpListener),
    Unix(UnixListener),
}

impl Listener {
    fn fd(&self) -> RawFd {
        match self {
            Listener::Tcp(l) => l.as_raw_fd(),
            Listener::Unix(l) => l.as_raw_fd(),
        }
    }

    fn accept(&self) -> io::Result<Stream> {
        match self {
            Listener::Tcp(l) => l.accept().map(|(s, _)| Stream::Tcp(s)),
            Listener::Unix(l) => l.accept().map(|(s, _)| Stream::Unix(s)),
        }
    }
}

/// A running endpoint. Dropping it (or [`Endpoint::shutdown`]) stops the
/// thread and removes the Unix socket file.
pub struct Endpoint {
    addr: MetricsAddr,
    /// The listening socket, shut down to wake the thread's accept().
    listen_fd: RawFd,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

/// Starts serving `queues` on `addr` (see [`MetricsAddr::parse`]). Call it
/// before installing the seccomp filter: binding may probe and replace a
/// stale socket file (socket, connect).
///
/// A Unix socket path that exists but has no listener (left by a crashed
/// daemon) is replaced; one with a live listener is `AddrInUse`; anything
/// else at that path is left alone and is an error. A TCP address that is
/// not loopback is allowed (Prometheus usually scrapes from another host)
/// but logged as a warning, since the counters reveal the guest's I/O
/// pattern.
pub fn spawn_endpoint(
    addr: &str,
    queues: Vec<Arc<QueueMetrics>>,
) -> Result<Endpoint, MetricsError> {
    let parsed = MetricsAddr::parse(addr);
    let bind_err = |source| MetricsError::Bind {
        addr: addr.to_string(),
        source,
    };
    let (listener, bound) = match &parsed {
        MetricsAddr::Unix(path) => {
            crate::unix_socket::remove_stale(path).map_err(bind_err)?;
            (
                Listener::Unix(UnixListener::bind(path).map_err(bind_err)?),
                parsed.clone(),
            )
        }
        MetricsAddr::Tcp(a) => {
            let l = TcpListener::bind(a).map_err(bind_err)?;
            let local = l.local_addr().map_err(bind_err)?;
            if !local.ip().is_loopback() {
                log::warn!("metrics endpoint on {local} is reachable from other hosts");
            }
            (Listener::Tcp(l), MetricsAddr::Tcp(local.to_string()))
        }
    };
    let poller = Poller::new().map_err(bind_err)?;
    let listen_fd = listener.fd();
    let stop = Arc::new(AtomicBool::new(false));
    let thread = {
        let stop = stop.clone();
        std::thread::Builder::new()
            .name("metrics".into())
            .spawn(move || serve(listener, &poller, &queues, &stop))
            .map_err(bind_err)?
    };
    log::info!("metrics on {bound} (GET /metrics, /metrics.json)");
    Ok(Endpoint {
        addr: bound,
        listen_fd,
        stop,
        thread: Some(thread),
    })
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
        // On Linux, shutdown() of a listening socket makes a blocked
        // accept() return EINVAL: no self-connection (socket/connect are
        // not in the seccomp allow-list) is needed to wake the thread.
        // SAFETY: the listener is owned by the thread, which has not been
        // joined yet, so the fd is still open and still the listener.
        unsafe { libc::shutdown(self.listen_fd, libc::SHUT_RDWR) };
        let _ = thread.join();
        if let MetricsAddr::Unix(p) = &self.addr {
            let _ = std::fs::remove_file(p);
        }
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        self.stop_thread();
    }
}

fn serve(listener: Listener, poller: &Poller, queues: &[Arc<QueueMetrics>], stop: &AtomicBool) {
    loop {
        let accepted = listener.accept();
        if stop.load(Ordering::Relaxed) {
            return;
        }
        match accepted {
            Ok(mut s) => {
                let deadline = Instant::now() + IO_TIMEOUT;
                let mut conn = Conn {
                    s: &mut s,
                    poller,
                    deadline,
                };
                if let Err(e) = conn.respond(queues) {
                    log::debug!("metrics connection: {e}");
                }
            }
            // EMFILE and the like: back off instead of spinning.
            Err(e) => {
                log::warn!("metrics accept: {e}");
                poller.sleep(Duration::from_millis(100));
            }
        }
    }
}

/// One accepted connection with its deadline.
struct Conn<'a> {
    s: &'a mut Stream,
    poller: &'a Poller,
    deadline: Instant,
}

impl Conn<'_> {
    /// Reads one request head and writes one response, then the caller closes.
    fn respond(&mut self, queues: &[Arc<QueueMetrics>]) -> io::Result<()> {
        self.s.set_nonblocking()?;
        let head = self.read_head()?;
        let first = head.lines().next().unwrap_or_default();
        let mut parts = first.split_whitespace();
        let (method, target) = (
            parts.next().unwrap_or_default(),
            parts.next().unwrap_or_default(),
        );
        let path = target.split('?').next().unwrap_or_default();
        let snapshot = || MetricsDoc {
            queues: queues.iter().map(|q| q.snapshot()).collect(),
        };
        let (status, ctype, body) = match (method, path) {
            ("GET", "/metrics") => (
                "200 OK",
                prometheus::CONTENT_TYPE,
                prometheus::encode(&snapshot().queues),
            ),
            ("GET", "/metrics.json") => {
                let body = serde_json::to_string(&snapshot()).map_err(io::Error::other)?;
                ("200 OK", "application/json", body)
            }
            ("GET", "/") => (
                "200 OK",
                "text/plain",
                "ringblk metrics: /metrics, /metrics.json\n".into(),
            ),
            ("GET", _) => ("404 Not Found", "text/plain", "not found\n".into()),
            _ => ("405 Method Not Allowed", "text/plain", "only GET\n".into()),
        };
        let mut out = format!(
            "HTTP/1.0 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            body.len()
        )
        .into_bytes();
        out.extend_from_slice(body.as_bytes());
        self.write_all(&out)
    }

    /// Reads until the blank line that ends the request head (at most 8 KiB).
    fn read_head(&mut self) -> io::Result<String> {
        let mut buf = Vec::with_capacity(512);
        let mut chunk = [0u8; 1024];
        while !buf.windows(4).any(|w| w == b"\r\n\r\n") && !buf.windows(2).any(|w| w == b"\n\n") {
            let n = match self.s.read(&mut chunk) {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    self.wait(libc::EPOLLIN)?;
                    continue;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            };
            if n == 0 {
                break;
            }
            buf.extend_from_slice(&chunk[..n]);
            if buf.len() > 8192 {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "request head too large",
                ));
            }
        }
        Ok(String::from_utf8_lossy(&buf).into_owned())
    }

    fn write_all(&mut self, mut data: &[u8]) -> io::Result<()> {
        while !data.is_empty() {
            match self.s.write(data) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => data = &data[n..],
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => self.wait(libc::EPOLLOUT)?,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    fn wait(&self, events: i32) -> io::Result<()> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() || !self.poller.wait(self.s.fd(), events, left)? {
            return Err(io::ErrorKind::TimedOut.into());
        }
        Ok(())
    }
}

/// An epoll instance for waiting on one fd at a time with a timeout.
struct Poller(OwnedFd);

impl Poller {
    fn new() -> io::Result<Poller> {
        // SAFETY: epoll_create1 takes no pointers.
        let fd = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` was just returned by epoll_create1 and is owned by
        // nothing else.
        Ok(Poller(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    /// Waits up to `timeout` for `events` on `fd`; false on timeout.
    fn wait(&self, fd: RawFd, events: i32, timeout: Duration) -> io::Result<bool> {
        let mut ev = libc::epoll_event {
            events: events as u32,
            u64: 0,
        };
        let ep = self.0.as_raw_fd();
        // SAFETY: `ev` is a valid epoll_event that the kernel only reads;
        // `fd` is an open socket of the caller.
        if unsafe { libc::epoll_ctl(ep, libc::EPOLL_CTL_ADD, fd, &mut ev) } < 0 {
            return Err(io::Error::last_os_error());
        }
        let n = self.epoll_wait(timeout);
        // SAFETY: as above; the event argument is ignored for DEL.
        unsafe { libc::epoll_ctl(ep, libc::EPOLL_CTL_DEL, fd, &mut ev) };
        Ok(n? > 0)
    }

    /// Sleeps by waiting on the (empty) epoll set: clock_nanosleep is not in
    /// the daemon's seccomp allow-list.
    fn sleep(&self, d: Duration) {
        let _ = self.epoll_wait(d);
    }

    fn epoll_wait(&self, timeout: Duration) -> io::Result<i32> {
        let ms = i32::try_from(timeout.as_millis())
            .unwrap_or(i32::MAX)
            .max(1);
        let mut out = [libc::epoll_event { events: 0, u64: 0 }];
        // SAFETY: `out` has room for the one event we ask for.
        let n = unsafe { libc::epoll_wait(self.0.as_raw_fd(), out.as_mut_ptr(), 1, ms) };
        if n < 0 {
            let e = io::Error::last_os_error();
            return if e.kind() == io::ErrorKind::Interrupted {
                Ok(0)
            } else {
                Err(e)
            };
        }
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::{RequestType, fetch, get};

    fn metrics() -> Vec<Arc<QueueMetrics>> {
        let q = Arc::new(QueueMetrics::default());
        q.count_request(RequestType::Read);
        QueueMetrics::add(&q.kicks, 3);
        vec![q, Arc::new(QueueMetrics::default())]
    }

    #[test]
    fn serves_over_tcp_and_unix() {
        let tcp = spawn_endpoint("127.0.0.1:0", metrics()).expect("bind tcp");
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("m.sock");
        let unix =
            spawn_endpoint(path.to_str().expect("utf-8 path"), metrics()).expect("bind unix");
        for addr in [tcp.local_addr(), unix.local_addr()] {
            let doc = fetch(&addr).expect("json");
            assert_eq!(doc.queues.len(), 2);
            assert_eq!(doc.queues[0].kicks, 3);
            let text = get(&addr, "/metrics").expect("text");
            assert!(text.contains("ringblk_requests_total{queue=\"0\",type=\"read\"} 1"));
            assert!(get(&addr, "/nope").is_err());
        }
        // A second daemon must not steal a live socket...
        assert!(spawn_endpoint(path.to_str().expect("utf-8"), metrics()).is_err());
        unix.shutdown();
        tcp.shutdown();
        // ...and shutdown cleans up so the next one can bind.
        assert!(!path.exists());
        drop(UnixListener::bind(&path).expect("stale socket"));
        let again = spawn_endpoint(path.to_str().expect("utf-8"), metrics());
        assert!(again.is_ok(), "a stale socket is replaced");
        drop(again);
        let file = dir.path().join("file");
        std::fs::write(&file, b"data").expect("write");
        assert!(spawn_endpoint(file.to_str().expect("utf-8"), metrics()).is_err());
        assert!(file.exists(), "a regular file is never removed");
    }
}
