//! The listener: an accept thread and a fixed pool of connection threads.
//! A connection past `max_connections` is closed at once, so the server
//! never holds more than that many connections, threads or reply buffers,
//! whatever clients do.

use std::collections::HashMap;
use std::io;
use std::net::Shutdown;
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::Duration;

use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

use super::session::{End, serve_connection};
use super::{Export, Limits};
use crate::metrics::ratelimit::SharedRateLimiter;

/// Connection ends worth a line (protocol errors, timeouts); a client that
/// reconnects in a loop must not fill the log.
static ENDS: SharedRateLimiter = SharedRateLimiter::new(10, Duration::from_secs(60));

/// What the server has seen.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ServerStats {
    /// Connections handed to a thread.
    pub served: u64,
    /// Connections closed at once because every thread was busy.
    pub refused: u64,
    /// Connections that ended with a protocol error or a deadline.
    pub failed: u64,
}

#[derive(Default)]
struct Shared {
    stopping: AtomicBool,
    served: AtomicU64,
    refused: AtomicU64,
    failed: AtomicU64,
    /// Connections accepted and not yet ended (queued or served).
    in_use: AtomicUsize,
    max: usize,
    /// The live connections, to shut them down on stop.
    live: Mutex<HashMap<u64, UnixStream>>,
}

/// A running NBD server on a listening Unix socket. Dropping it stops it.
pub struct Server {
    shared: Arc<Shared>,
    /// Written to wake the accept thread when stopping (an eventfd: the
    /// daemon's seccomp filter has no socketpair).
    waker: Arc<EventFd>,
    accept: Option<JoinHandle<()>>,
    workers: Vec<JoinHandle<()>>,
}

impl Server {
    /// Serves `export` on `listener` (bound by the caller, with the mode it
    /// wants: the daemon binds it 0600) until [`stop`](Self::stop).
    pub fn start(
        listener: UnixListener,
        export: Arc<dyn Export>,
        limits: Limits,
    ) -> io::Result<Server> {
        let limits = Limits {
            max_connections: limits.max_connections.max(1),
            ..limits
        };
        listener.set_nonblocking(true)?;
        let waker = Arc::new(EventFd::new(EFD_NONBLOCK)?);
        let wake_rx = waker.clone();
        let shared = Arc::new(Shared {
            max: limits.max_connections,
            ..Shared::default()
        });
        // Never full: a connection is queued only under the cap.
        let (tx, rx) = sync_channel::<(u64, UnixStream)>(limits.max_connections);
        let rx = Arc::new(Mutex::new(rx));
        let mut workers = Vec::with_capacity(limits.max_connections);
        for i in 0..limits.max_connections {
            let (rx, shared, export, limits) =
                (rx.clone(), shared.clone(), export.clone(), limits.clone());
            workers.push(
                thread::Builder::new()
                    .name(format!("nbd-{i}"))
                    .spawn(move || worker(&rx, &shared, &*export, &limits))?,
            );
        }
        let accept = {
            let shared = shared.clone();
            thread::Builder::new()
                .name("nbd-accept".into())
                .spawn(move || accept_loop(&listener, &wake_rx, &tx, &shared))?
        };
        Ok(Server {
            shared,
            waker,
            accept: Some(accept),
            workers,
        })
    }

    /// What the server has seen so far.
    pub fn stats(&self) -> ServerStats {
        ServerStats {
            served: self.shared.served.load(Ordering::Relaxed),
            refused: self.shared.refused.load(Ordering::Relaxed),
            failed: self.shared.failed.load(Ordering::Relaxed),
        }
    }

    /// Stops accepting, ends every connection and joins the threads.
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        self.shared.stopping.store(true, Ordering::Release);
        let _ = self.waker.write(1);
        if let Some(a) = self.accept.take() {
            let _ = a.join();
        }
        // The accept thread has dropped the sender: idle workers return.
        // Busy ones see their socket shut down.
        for s in self
            .shared
            .live
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
        {
            let _ = s.shutdown(Shutdown::Both);
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn accept_loop(
    listener: &UnixListener,
    wake: &EventFd,
    tx: &SyncSender<(u64, UnixStream)>,
    shared: &Shared,
) {
    let mut next_id = 0u64;
    loop {
        let mut fds = [
            libc::pollfd {
                fd: listener.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: wake.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: `fds` is a valid array of two pollfds that outlives the
        // call; both descriptors are open (borrowed from live objects).
        let r = unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                log::error!("nbd: poll failed: {e}");
                thread::sleep(Duration::from_millis(100));
            }
            continue;
        }
        if shared.stopping.load(Ordering::Acquire) || fds[1].revents != 0 {
            return;
        }
        match listener.accept() {
            Ok((stream, _)) => {
                let taken = shared
                    .in_use
                    .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                        (n < shared.max).then_some(n + 1)
                    });
                if taken.is_err() {
                    // At the cap: the stream is dropped, which closes it.
                    shared.refused.fetch_add(1, Ordering::Relaxed);
                    crate::info_limited!(
                        ENDS,
                        "nbd: connection refused: {} connections already",
                        shared.max
                    );
                    continue;
                }
                next_id += 1;
                if tx.send((next_id, stream)).is_err() {
                    return;
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => {
                // EMFILE, ENFILE, ENOBUFS, ECONNABORTED: never fatal; back
                // off so a full fd table does not spin.
                crate::warn_limited!(ENDS, "nbd: accept failed: {e}");
                thread::sleep(Duration::from_millis(50));
            }
        }
    }
}

fn worker(
    rx: &Mutex<Receiver<(u64, UnixStream)>>,
    shared: &Shared,
    export: &dyn Export,
    limits: &Limits,
) {
    loop {
        let next = rx.lock().unwrap_or_else(|p| p.into_inner()).recv();
        let Ok((id, stream)) = next else { return };
        serve_one(id, stream, shared, export, limits);
        shared.in_use.fetch_sub(1, Ordering::AcqRel);
    }
}

fn serve_one(id: u64, stream: UnixStream, shared: &Shared, export: &dyn Export, limits: &Limits) {
    shared.served.fetch_add(1, Ordering::Relaxed);
    let Ok(clone) = stream.try_clone() else {
        return;
    };
    shared
        .live
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(id, clone);
    // Registered first, checked second: a stop that began meanwhile
    // either sees it in `live` or is seen here.
    let end = if shared.stopping.load(Ordering::Acquire) {
        End::Closed
    } else {
        serve_connection(stream, export, limits)
    };
    shared
        .live
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .remove(&id);
    match end {
        End::Disconnect | End::Abort | End::Closed => {
            log::debug!("nbd: connection {id}: {end}")
        }
        _ => {
            shared.failed.fetch_add(1, Ordering::Relaxed);
            crate::info_limited!(ENDS, "nbd: connection {id} ended: {end}");
        }
    }
}
