//! The daemon: configuration, the socket, signals and the serve loop.
//!
//! One vhost-user connection at a time. Each connection gets a fresh
//! backend (rings, workers, io_urings); the counters live across them. When
//! the front-end goes away the daemon waits for the next one, so a VM
//! reboot or a QEMU restart needs no daemon restart.

mod config;
mod seccomp;
mod socket;

use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use vhost::vhost_user::Listener;
use vhost_user_backend::VhostUserDaemon;
use vm_memory::GuestMemoryAtomic;
use vmm_sys_util::epoll::EventSet;

use crate::cli::{EngineKind, ServeArgs};
use crate::engine::{Engine, EngineError, NullEngine, UringEngine};
use crate::io::ImageError;
use crate::metrics::QueueMetrics;
use crate::vhost::{BlkBackend, Drain, ExitEvents, QueueWorker, WorkerConfig, proxy};
use crate::virtio::config::{config_space, device_features};
use crate::virtio::{GuestMem, SECTOR_SHIFT};

pub use config::Config;

/// Why the daemon cannot start or go on. Messages are one line.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error("{0}")]
    Config(String),
    #[error(transparent)]
    Image(#[from] ImageError),
    #[error("socket {0}")]
    Socket(String),
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error("vhost-user: {0}")]
    Vhost(String),
    #[error("signals: {0}")]
    Signals(std::io::Error),
    #[error("seccomp: {0}")]
    Seccomp(String),
}

/// The backend serving the current connection, for the signal handler.
type Current = Arc<Mutex<Option<Arc<dyn Drain>>>>;

/// Runs `ringblk serve` until SIGINT/SIGTERM.
pub fn serve(args: ServeArgs) -> Result<(), DaemonError> {
    let cfg = Config::from_args(args)?;
    let listener = socket::bind(&cfg.args.socket, cfg.args.socket_mode)?;
    let num_queues = usize::from(cfg.args.queues);
    let metrics: Vec<Arc<QueueMetrics>> = (0..num_queues).map(|_| Arc::default()).collect();
    // Bound before the seccomp filter: binding probes for a stale socket.
    let _endpoint = match &cfg.args.metrics {
        Some(addr) => Some(
            crate::metrics::spawn_endpoint(addr, metrics.clone())
                .map_err(|e| DaemonError::Config(format!("--metrics: {e}")))?,
        ),
        None => None,
    };
    let worker_cfg = Arc::new(cfg.worker);
    let current: Current = Arc::default();
    let mut inner = InnerSocket::new()?;
    // One queue thread per queue (`BlkBackend::queues_per_thread`).
    let exit_events = Arc::new(
        ExitEvents::new(num_queues)
            .map_err(|e| DaemonError::Vhost(format!("exit eventfds: {e}")))?,
    );
    spawn_signal_handler(
        &cfg.args,
        &cfg.image.file,
        worker_cfg.clone(),
        current.clone(),
        inner.paths.clone(),
    )?;
    announce(&cfg.args, &cfg.image, cfg.image_created, &worker_cfg);

    let features = device_features(cfg.args.readonly);
    let space = config_space(&worker_cfg.limits, cfg.args.queues, !cfg.args.writethrough);
    // Before the filter: installing it calls rt_sigaction.
    crate::vhost::sigbus::install().map_err(DaemonError::Signals)?;
    seccomp::install(cfg.args.seccomp)?;
    let conn = Connections {
        args: &cfg.args,
        listener: &listener,
        metrics: &metrics,
        worker_cfg: &worker_cfg,
        exit_events: &exit_events,
        current: &current,
        inner: &mut inner,
        space,
        features,
    };
    match cfg.args.engine {
        EngineKind::Uring => conn.serve(|m| UringEngine::new(cfg.uring.clone(), m.clone())),
        EngineKind::Null => {
            let capacity = usize::from(cfg.args.queue_size);
            conn.serve(|_| Ok(NullEngine::new(capacity)))
        }
    }
}

/// What every connection is served with.
struct Connections<'a> {
    args: &'a ServeArgs,
    listener: &'a UnixListener,
    metrics: &'a [Arc<QueueMetrics>],
    worker_cfg: &'a Arc<WorkerConfig>,
    exit_events: &'a Arc<ExitEvents>,
    current: &'a Current,
    inner: &'a mut InnerSocket,
    space: [u8; crate::virtio::config::CONFIG_LEN],
    features: u64,
}

impl Connections<'_> {
    /// Serves one front-end after the other, each with fresh workers and
    /// engines from `engine`, until the process is stopped.
    fn serve<E: Engine + 'static>(
        self,
        engine: impl Fn(&Arc<QueueMetrics>) -> Result<E, EngineError>,
    ) -> Result<(), DaemonError> {
        let (args, worker_cfg) = (self.args, self.worker_cfg);
        loop {
            let replaced = crate::vhost::sigbus::replaced_pages();
            let front = accept(self.listener)?;
            let workers = self
                .metrics
                .iter()
                .enumerate()
                .map(|(i, m)| {
                    let cpu = (!args.cpus.is_empty()).then(|| args.cpus[i % args.cpus.len()]);
                    Ok(QueueWorker::new(
                        worker_cfg.clone(),
                        m.clone(),
                        engine(m)?,
                        cpu,
                    ))
                })
                .collect::<Result<Vec<_>, EngineError>>()?;
            // The guest may have turned the write cache off; a new connection
            // starts from what we advertise.
            worker_cfg
                .writeback
                .store(!args.writethrough, Ordering::Relaxed);
            let backend = Arc::new(BlkBackend::new(
                worker_cfg.clone(),
                workers,
                self.space,
                self.features,
                self.exit_events.clone(),
            ));
            let mut daemon = VhostUserDaemon::new(
                "ringblk".into(),
                backend.clone(),
                GuestMemoryAtomic::new(GuestMem::new()),
            )
            .map_err(|e| DaemonError::Vhost(e.to_string()))?;
            for (i, h) in daemon.get_epoll_handlers().iter().enumerate() {
                if let Some(fd) = backend.worker(i).completion_fd() {
                    h.register_listener(fd, EventSet::IN, backend.completion_event_id())
                        .map_err(|e| {
                            DaemonError::Vhost(format!("registering completion eventfd: {e}"))
                        })?;
                }
            }
            *self.current.lock().unwrap_or_else(|p| p.into_inner()) = Some(backend.clone());
            // vhost-user-backend accepts its own connection; give it one end of
            // a private socket and relay the front-end's messages to it.
            let back = self.inner.connect()?;
            daemon
                .start(&mut self.inner.listener)
                .map_err(|e| DaemonError::Vhost(e.to_string()))?;
            let relay = proxy::relay(front, back, backend.clone())
                .map_err(|e| DaemonError::Vhost(format!("relay: {e}")))?;
            log::info!("front-end connected");
            match daemon.wait() {
                Ok(())
                | Err(vhost_user_backend::Error::HandleRequest(
                    vhost::vhost_user::Error::Disconnected,
                )) => {
                    log::info!("front-end disconnected; waiting for the next one")
                }
                Err(e) => log::warn!("connection ended: {e}; waiting for the next one"),
            }
            // Every worker stops taking kicks and finishes what it took,
            // before its thread is told to exit and the workers are dropped.
            backend.drain_all();
            let replaced = crate::vhost::sigbus::replaced_pages() - replaced;
            if replaced > 0 {
                log::warn!(
                    "the front-end shrank its memory under its own guest: {replaced} page(s) past the end of their file were replaced with zero pages"
                );
            }
            for h in daemon.get_epoll_handlers() {
                h.send_exit_event();
            }
            for t in relay {
                let _ = t.join();
            }
            *self.current.lock().unwrap_or_else(|p| p.into_inner()) = None;
        }
    }
}

fn accept(listener: &UnixListener) -> Result<UnixStream, DaemonError> {
    loop {
        match listener.accept() {
            Ok((s, _)) => return Ok(s),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionAborted => continue,
            Err(e) => return Err(DaemonError::Socket(format!("accept: {e}"))),
        }
    }
}

/// The socket between the relay and vhost-user-backend, in a private
/// directory (mode 0700) so only this user can connect to it. Bound once,
/// before the seccomp filter; each connection accepts on it again.
struct InnerSocket {
    paths: InnerPaths,
    listener: Listener,
}

/// Where the inner socket lives, for clean-up on exit.
#[derive(Clone)]
struct InnerPaths {
    dir: PathBuf,
    sock: PathBuf,
}

impl InnerPaths {
    /// Removes the socket and its directory: two syscalls the seccomp
    /// filter allows (unlink, rmdir), no directory walk.
    fn remove(&self) {
        let _ = std::fs::remove_file(&self.sock);
        let _ = std::fs::remove_dir(&self.dir);
    }
}

impl InnerSocket {
    fn new() -> Result<InnerSocket, DaemonError> {
        // A fresh name each time (mkdtemp), not one derived from our pid: a
        // daemon killed with SIGKILL leaves its directory behind, and a
        // later daemon with the same pid but another user could neither
        // remove nor reuse it.
        let tmp = std::env::temp_dir();
        let dir = tempfile::Builder::new()
            .prefix("ringblk-")
            .permissions(std::fs::Permissions::from_mode(0o700))
            .tempdir_in(&tmp)
            .map_err(|e| {
                DaemonError::Socket(format!("private directory in {}: {e}", tmp.display()))
            })?
            // Removed by InnerPaths::remove, which also runs on signals.
            .keep();
        let err = |e: std::io::Error| DaemonError::Socket(format!("{}: {e}", dir.display()));
        let sock = dir.join("backend.sock");
        let listener = Listener::from(UnixListener::bind(&sock).map_err(err)?);
        Ok(InnerSocket {
            paths: InnerPaths { dir, sock },
            listener,
        })
    }

    /// The stream the relay writes to; the crate accepts its other end.
    fn connect(&self) -> Result<UnixStream, DaemonError> {
        UnixStream::connect(&self.paths.sock)
            .map_err(|e| DaemonError::Socket(format!("{}: {e}", self.paths.sock.display())))
    }
}

impl Drop for InnerSocket {
    fn drop(&mut self) {
        self.paths.remove();
    }
}

/// SIGINT/SIGTERM: stop taking requests, finish what is in flight, make it
/// durable, remove the socket, exit 0.
fn spawn_signal_handler(
    args: &ServeArgs,
    image: &std::fs::File,
    cfg: Arc<WorkerConfig>,
    current: Current,
    inner: InnerPaths,
) -> Result<(), DaemonError> {
    use signal_hook::consts::{SIGINT, SIGTERM};
    let mut signals =
        signal_hook::iterator::Signals::new([SIGINT, SIGTERM]).map_err(DaemonError::Signals)?;
    // process::exit skips destructors: remove what they would have.
    let mut files = vec![args.socket.clone()];
    if let Some(crate::metrics::MetricsAddr::Unix(p)) = args
        .metrics
        .as_deref()
        .map(crate::metrics::MetricsAddr::parse)
    {
        files.push(p);
    }
    let image = image.try_clone().map_err(DaemonError::Signals)?;
    std::thread::Builder::new()
        .name("signals".into())
        .spawn(move || {
            if let Some(sig) = signals.forever().next() {
                log::info!("signal {sig}: finishing in-flight requests");
                cfg.stopping.store(true, Ordering::Relaxed);
                if let Some(b) = current.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
                    b.drain_all();
                }
                if let Err(e) = image.sync_data() {
                    log::error!("fdatasync of the image failed: {e}");
                }
                for f in &files {
                    let _ = std::fs::remove_file(f);
                }
                inner.remove();
                log::info!("stopped");
                std::process::exit(0);
            }
        })
        .map_err(DaemonError::Signals)?;
    Ok(())
}

/// Tells the user what is being served and how to connect.
fn announce(args: &ServeArgs, image: &crate::io::Image, created: bool, cfg: &WorkerConfig) {
    if created {
        log::info!(
            "created sparse image {} ({} bytes)",
            image.path.display(),
            image.size
        );
    }
    log::info!(
        "serving {} ({} sectors, {}-byte blocks{}{}) on {} with {} queue(s) of {}, serial {}",
        image.path.display(),
        image.size >> SECTOR_SHIFT,
        image.block_size,
        if args.readonly { ", read-only" } else { "" },
        if args.direct { ", O_DIRECT" } else { "" },
        args.socket.display(),
        args.queues,
        args.queue_size,
        String::from_utf8_lossy(&cfg.serial).trim_end_matches('\0'),
    );
    println!(
        "Connect QEMU with:\n  qemu-system-x86_64 -m 1G -object memory-backend-memfd,id=mem,size=1G,share=on \
         -numa node,memdev=mem -chardev socket,id=rb0,path={} \
         -device vhost-user-blk-pci,chardev=rb0,num-queues={} ...",
        args.socket.display(),
        args.queues
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two inner sockets of one process (one pid) must not share, or
    /// remove, each other's directory: the name is not derived from the
    /// pid, which a later daemon of another user may get again.
    #[test]
    fn inner_sockets_get_private_directories_of_their_own() {
        let a = InnerSocket::new().expect("first inner socket");
        let b = InnerSocket::new().expect("second inner socket");
        assert_ne!(a.paths.dir, b.paths.dir);
        for s in [&a, &b] {
            let meta = std::fs::metadata(&s.paths.dir).expect("directory exists");
            assert_eq!(meta.permissions().mode() & 0o777, 0o700);
            s.connect().expect("connects");
        }
        let dir = a.paths.dir.clone();
        drop(a);
        assert!(!dir.exists(), "{} removed on drop", dir.display());
        b.connect().expect("the other one still connects");
    }
}
