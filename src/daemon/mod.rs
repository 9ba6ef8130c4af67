//! The daemon: configuration, the socket, signals and the serve loop.
//!
//! One vhost-user connection at a time. Each connection gets a fresh
//! backend and fresh workers; the engines (with their io_urings, made once
//! before the seccomp filter), the device and the counters live across
//! them: a connection borrows the engines and gives them back. When the
//! front-end goes away the daemon waits for the next one, so a VM reboot
//! or a QEMU restart needs no daemon restart.

mod args;
mod config;
mod connector;
mod crash;
mod fds;
mod landlock;
mod notify;
mod removal;
mod seccomp;
mod socket;

use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use vhost::vhost_user::Listener;
use vhost_user_backend::VhostUserDaemon;
use vm_memory::GuestMemoryAtomic;
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

use crate::device::{Connection, Device};
use crate::engine::{Core, Engine, EngineError, ImageFormat, NullEngine, UringEngine};
use crate::io::ImageError;
use crate::metrics::{QueueMetrics, RateLimiter};
use crate::queue::{QueueWorker, Settings, Timer};
use crate::vhost::{BlkBackend, ExitEvents, relay};
use crate::virtio::GuestMem;
use crate::warn_limited;
pub use args::{EngineKind, SeccompMode, ServeArgs};
use removal::Removal;

pub use config::{Config, Listen};
use notify::Notifier;

/// The control API on `path` (mode 0600, bound before the seccomp filter).
fn spawn_api(
    path: &Path,
    device: &Arc<Device>,
    metrics: &[Arc<QueueMetrics>],
    identity: crate::api::Identity,
) -> Result<crate::api::Endpoint, DaemonError> {
    let err = |e: String| DaemonError::Config(format!("--api {}: {e}", path.display()));
    let listener = socket::bind(path, 0o600).map_err(|e| err(e.to_string()))?;
    let endpoint = crate::api::spawn(
        crate::api::Bound::Unix(listener),
        crate::metrics::MetricsAddr::Unix(path.to_path_buf()),
        metrics.to_vec(),
        Some(Arc::new(crate::api::Control::new(device.clone(), identity))),
        Some(device.clone()),
    )
    .map_err(|e| err(e.to_string()))?;
    log::info!(
        "control API on {} ({})",
        path.display(),
        crate::api::verb_list(true)
    );
    Ok(endpoint)
}

/// Why the daemon cannot start or go on. Messages are one line.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    /// The command line is wrong in itself (exit status 2).
    #[error("{0}")]
    Usage(String),
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
    #[error("landlock: {0}")]
    Landlock(String),
    /// The relay's connection to vhost-user-backend cannot be made (see
    /// `connector`): no front-end can be served any more.
    #[error("inner socket {0}")]
    Inner(String),
}

/// What the signal handler runs at shutdown, once the queues have drained,
/// to release what the process exit alone would not (an RBD image's watch
/// and exclusive lock); set once the engines exist.
type Closer = Arc<Mutex<Option<Box<dyn FnOnce() + Send>>>>;

/// The engines (in their cores) between connections; a connection takes
/// them and puts them back. Shared with the [`Closer`], which drops them at
/// shutdown.
type Parked<E> = Arc<Mutex<Vec<Core<E>>>>;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Runs `ringblk serve` until SIGINT, SIGTERM or SIGHUP.
pub fn serve(args: ServeArgs) -> Result<(), DaemonError> {
    let started = std::time::Instant::now();
    // First, while this is the only thread (both read and clear the
    // environment: LISTEN_FDS, NOTIFY_SOCKET), and before the daemon opens
    // anything: the socket passed in, so that its number cannot name a
    // descriptor the daemon made itself (see `Listen::passed`).
    let passed = Listen::passed(&args)?;
    let notifier = Notifier::from_env().map_err(DaemonError::Config)?;
    crash::install();
    // The fds a front-end needs must not run out before the hard limit
    // does (see `fds` for the share no HTTP client can take).
    if let Err(e) = fds::raise_limit() {
        log::warn!("cannot raise the fd limit to its hard limit: {e}");
    }
    // Early, while the daemon has few descriptors and threads: it forks the
    // connector process (`connector`).
    let mut inner = InnerSocket::new()?;
    let cfg = Config::from_args(args, passed)?;
    let num_queues = usize::from(cfg.args.queues);
    let metrics: Vec<Arc<QueueMetrics>> = (0..num_queues).map(|_| Arc::default()).collect();
    // Registered before the first socket is bound: a script or a service
    // manager that finds a socket may send SIGTERM at once, and that must
    // be a clean stop (the handler thread picks it up once it runs), not
    // the default action, which would leave the sockets behind.
    let signals = Signals::new().map_err(DaemonError::Signals)?;
    // The workers, the backend and the endpoints share the device.
    let device = Arc::new(cfg.device);
    // Bound before the seccomp filter: binding probes for a stale socket.
    let _endpoint = match &cfg.args.metrics {
        Some(addr) => Some(
            crate::api::spawn_metrics(addr, metrics.clone(), Some(device.clone()))
                .map_err(|e| DaemonError::Config(format!("--metrics: {e}")))?,
        ),
        None => None,
    };
    // Before the vhost-user socket listens: what a daemon killed on the
    // image left (`Device::recover_image`).
    device.recover_image();
    if device.qos().active() {
        log::info!("QoS limits: {}", device.qos().limits().summary());
    }
    let socket_name = cfg.listen.name();
    let _api = match &cfg.args.api {
        Some(path) => {
            let identity = crate::api::Identity {
                socket: socket_name.clone(),
                started,
            };
            Some(spawn_api(path, &device, &metrics, identity)?)
        }
        None => None,
    };
    // The vhost-user socket listens last: a front-end (or a script) that
    // finds it can use the API and the metrics endpoint at once.
    // The path the daemon bound, and removes on its way out.
    let mut bound = None;
    let listener = match cfg.listen {
        Listen::Bind(path) => {
            let l = socket::bind(&path, cfg.args.socket_mode)?;
            bound = Some(path);
            l
        }
        Listen::Fd {
            listener: l, from, ..
        } => {
            log::info!("using the listening socket passed by {from}: {socket_name}");
            l
        }
    };
    // `--threads` queue threads (`BlkBackend::queues_per_thread`).
    let threads = cfg.threads;
    let exit_events = Arc::new(
        ExitEvents::new(threads).map_err(|e| DaemonError::Vhost(format!("exit eventfds: {e}")))?,
    );
    // Each queue's resume eventfd, for taking turns on a shared thread:
    // made once, like the engines, and reused by every connection.
    let resume = (0..if threads < num_queues { num_queues } else { 0 })
        .map(|_| EventFd::new(EFD_NONBLOCK).map(Arc::new))
        .collect::<std::io::Result<Vec<_>>>()
        .map_err(|e| DaemonError::Vhost(format!("resume eventfds: {e}")))?;
    // Each queue's wake-up timer (QoS, the image lock), made once too:
    // the filter forbids timerfd_create.
    let timers = (0..num_queues)
        .map(|_| Timer::new().map(Arc::new))
        .collect::<std::io::Result<Vec<_>>>()
        .map_err(|e| DaemonError::Vhost(format!("queue timers: {e}")))?;
    // The sockets the daemon removes on its way out, by directory fd.
    let removal = |p: &std::path::Path| {
        Removal::file(p).map_err(|e| DaemonError::Socket(format!("{}: {e}", p.display())))
    };
    let mut files = Vec::new();
    if let Some(path) = &bound {
        files.push(removal(path)?);
    }
    if let Some(crate::metrics::MetricsAddr::Unix(p)) = cfg
        .args
        .metrics
        .as_deref()
        .map(crate::metrics::MetricsAddr::parse)
    {
        files.push(removal(&p)?);
    }
    if let Some(p) = &cfg.args.api {
        files.push(removal(p)?);
    }
    let mut unlink_dirs: Vec<i32> = files
        .iter()
        .chain(&inner.paths.removals)
        .map(Removal::dir_fd)
        .collect();
    // A removed bitmap's sidecar, a backup's socket.
    unlink_dirs.extend(cfg.bitmap_dir.iter().chain(&cfg.backup_dir).map(|d| d.1));
    let extras = seccomp::Extras {
        bitmap_dir: cfg.bitmap_dir.as_ref().map(|d| d.1),
        backups: cfg.backup_dir.is_some(),
    };
    // A qcow2 image's snapshot directory: overlays are created and (when
    // a snapshot fails) removed there, by its descriptor.
    let snapshot_dir = device
        .chain()
        .and_then(|live| live.snapshot_dir())
        .map(|d| d.file().try_clone().map(|f| (f, d.fd())))
        .transpose()
        .map_err(|e| DaemonError::Landlock(format!("the snapshot directory: {e}")))?;
    let unlink_dirs: Vec<i32> = unlink_dirs
        .into_iter()
        .chain(snapshot_dir.as_ref().map(|(_, fd)| *fd))
        .collect();
    // What Landlock leaves the daemon after start-up.
    let sandbox = landlock::Allowed {
        image: cfg
            .backing
            .file()
            .map(|f| f.try_clone().map(|f| (f, !cfg.args.readonly)))
            .transpose()
            .map_err(|e| DaemonError::Landlock(format!("the image: {e}")))?,
        // A qcow2 image's backing chain, read-only.
        backing: match device.chain() {
            Some(live) => live
                .current()
                .image
                .files()
                .iter()
                .skip(1)
                .map(|f| f.try_clone())
                .collect::<std::io::Result<_>>()
                .map_err(|e| DaemonError::Landlock(format!("a backing file: {e}")))?,
            None => Vec::new(),
        },
        snapshot_dir: snapshot_dir
            .as_ref()
            .map(|(f, _)| f.try_clone())
            .transpose()
            .map_err(|e| DaemonError::Landlock(format!("the snapshot directory: {e}")))?,
        removals: files.iter().chain(&inner.paths.removals).cloned().collect(),
        bitmap_dir: cfg.bitmap_dir.map(|d| d.0),
        backup_dir: cfg.backup_dir.map(|d| d.0),
    };
    let closer = Closer::default();
    spawn_signal_handler(
        signals,
        device.clone(),
        closer.clone(),
        files,
        inner.paths.clone(),
        notifier.try_clone().map_err(DaemonError::Signals)?,
    )?;
    // Once start-up has worked: a start that fails prints its error alone.
    warn_if_root();
    announce(&socket_name, &cfg.args, &cfg.backing, &device, threads);

    let conn = Connections {
        args: &cfg.args,
        listener: &listener,
        metrics: &metrics,
        device: &device,
        settings: cfg.settings,
        threads,
        exit_events: &exit_events,
        resume: &resume,
        timers: &timers,
        inner: &mut inner,
        unlink_dirs,
        extras,
        open_dir: snapshot_dir.as_ref().map(|(_, fd)| *fd),
        sandbox,
        profile: match &cfg.backing {
            config::Backing::File { .. } => seccomp::Profile::File,
            #[cfg(feature = "rbd")]
            config::Backing::Rbd(_) => seccomp::Profile::Rbd,
        },
        log_limit: RateLimiter::new(10, Duration::from_secs(5)),
        notifier,
    };
    // Every engine (and so every io_uring) the daemon will ever use is made
    // now, before the seccomp filter, which then forbids io_uring_setup:
    // code that gained control could not make a ring of its own. Each
    // connection borrows them and gives them back.
    let capacity = usize::from(cfg.args.queue_size);
    // The format's handles are cloned out: the backing is moved into the
    // match below (the RBD arm hands its disk to the closer).
    let chain = match &cfg.backing {
        config::Backing::File { chain, .. } => {
            chain.as_ref().map(|q| (q.live.clone(), q.meta.clone()))
        }
        #[cfg(feature = "rbd")]
        config::Backing::Rbd(_) => None,
    };
    let luks = match &cfg.backing {
        config::Backing::File { luks, .. } => luks.as_ref().map(|l| (l.offset, l.crypt.clone())),
        #[cfg(feature = "rbd")]
        config::Backing::Rbd(_) => None,
    };
    let format = move || match (&chain, &luks) {
        (Some((live, meta)), _) => ImageFormat::chain(live.clone(), meta.clone()),
        (None, Some((offset, crypt))) => ImageFormat::Luks(Box::new((*offset, crypt.clone()))),
        (None, None) => ImageFormat::Raw,
    };
    match (cfg.args.engine, cfg.backing) {
        (EngineKind::Null, _) => conn.serve(park(
            engines(&metrics, |_| Ok(NullEngine::new(capacity)))?,
            format,
            &device,
        )?),
        (EngineKind::Uring, config::Backing::File { uring, .. }) => conn.serve(park(
            engines(&metrics, |m| UringEngine::new(uring.clone(), m.clone()))?,
            format,
            &device,
        )?),
        // librbd's threads and sockets are made here too, before the
        // filter; the filter then covers them as well (TSYNC).
        #[cfg(feature = "rbd")]
        (EngineKind::Uring, config::Backing::Rbd(disk)) => {
            let name = disk.opts.spec.to_string();
            if cfg.args.poll_us > 0 {
                log::info!(
                    "{name}: no busy-polling (--poll-us {} ignored): librbd completes on its own threads, rarely within a window",
                    cfg.args.poll_us
                );
            }
            let engines = metrics
                .iter()
                .map(|_| disk.engine(capacity))
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| DaemonError::Config(format!("{name}: {e}")))?;
            let parked = park(engines, format, &device)?;
            // At shutdown, after the drain: the image handle closes when
            // the last engine and the disk let go of it (rbd_close gives up
            // the watch and the exclusive lock, so a daemon started next on
            // the image need not wait for the OSD to time the watch out),
            // then the pool and the cluster connection.
            // A connection ending as the signal came has its engines in
            // neither place for a moment: wait (briefly) until the disk
            // holds the last reference, so that dropping it closes.
            let (engines, device) = (parked.clone(), device.clone());
            *lock(&closer) = Some(Box::new(move || {
                let deadline = std::time::Instant::now() + CLOSE_WAIT;
                loop {
                    if let Some(c) = device.connection() {
                        c.close_engines();
                    }
                    drop(std::mem::take(&mut *lock(&engines)));
                    if Arc::strong_count(disk.image()) == 1 || std::time::Instant::now() > deadline
                    {
                        break;
                    }
                    std::thread::sleep(std::time::Duration::from_millis(5));
                }
                if Arc::strong_count(disk.image()) > 1 {
                    log::warn!(
                        "{name}: still in use after {CLOSE_WAIT:?}; exiting without closing it (its lock waits for the watch timeout)"
                    );
                }
                drop(disk);
            }));
            conn.serve(parked)
        }
    }
}

/// Running as root gives a bug that a front-end or an image reaches all of
/// root's reach; the daemon needs none of it.
fn warn_if_root() {
    // SAFETY: geteuid takes no arguments and cannot fail.
    if unsafe { libc::geteuid() } == 0 {
        log::warn!(
            "running as root (effective uid 0): the daemon needs no privileges. Run it as a \
             dedicated user that owns the image and the socket directory (systemd: User= or \
             DynamicUser=; by hand: setpriv --reuid=ringblk --regid=ringblk --clear-groups); \
             see docs/security.md"
        );
    }
}

/// How long SIGTERM waits for the engines of a connection being torn
/// down before it closes the RBD image.
#[cfg(feature = "rbd")]
const CLOSE_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// Each engine in its core, with its queue's view of the image's format,
/// parked.
fn park<E: Engine>(
    engines: Vec<E>,
    format: impl Fn() -> ImageFormat,
    device: &Arc<Device>,
) -> Result<Parked<E>, DaemonError> {
    let cores = engines
        .into_iter()
        .map(|e| Core::with_format(e, format(), device.clone()))
        .collect::<std::io::Result<_>>()
        .map_err(|e| DaemonError::Config(format!("the engines: {e}")))?;
    Ok(Arc::new(Mutex::new(cores)))
}

/// One engine per queue.
fn engines<E>(
    metrics: &[Arc<QueueMetrics>],
    make: impl Fn(&Arc<QueueMetrics>) -> Result<E, EngineError>,
) -> Result<Vec<E>, EngineError> {
    metrics.iter().map(make).collect()
}

/// What every connection is served with.
struct Connections<'a> {
    args: &'a ServeArgs,
    listener: &'a UnixListener,
    metrics: &'a [Arc<QueueMetrics>],
    device: &'a Arc<Device>,
    settings: Settings,
    /// Worker threads (`--threads`).
    threads: usize,
    exit_events: &'a Arc<ExitEvents>,
    /// Each queue's resume eventfd, when threads serve several queues.
    resume: &'a [Arc<EventFd>],
    /// Each queue's wake-up timer.
    timers: &'a [Arc<Timer>],
    inner: &'a mut InnerSocket,
    /// Directory fds the daemon may remove files in after start-up.
    unlink_dirs: Vec<i32>,
    /// What the seccomp filter allows for bitmaps and backups.
    extras: seccomp::Extras,
    /// The directory fd the daemon may create files in after start-up (a
    /// qcow2 image's snapshot directory).
    open_dir: Option<i32>,
    /// What Landlock allows after start-up; taken when it is applied.
    sandbox: landlock::Allowed,
    /// What the seccomp filter allows besides the daemon's own syscalls.
    profile: seccomp::Profile,
    log_limit: RateLimiter,
    /// READY=1 once the filter is on and the first accept is next.
    notifier: Notifier,
}

/// Why a connection ended early.
enum ConnectionError {
    /// This connection failed (a front-end, or a resource it needed); the
    /// daemon waits for the next one.
    Lost(DaemonError),
    /// The daemon cannot go on.
    Fatal(DaemonError),
}

impl Connections<'_> {
    /// Installs the seccomp filter, then serves one front-end after the
    /// other, each with fresh workers over `engines`, until the process is
    /// stopped. What goes wrong with one connection is logged and the
    /// daemon waits for the next.
    fn serve<E: Engine + 'static>(mut self, engines: Parked<E>) -> Result<(), DaemonError> {
        // Before the filter: installing it calls rt_sigaction.
        crate::vhost::sigbus::install().map_err(DaemonError::Signals)?;
        let endpoints =
            usize::from(self.args.api.is_some()) + usize::from(self.args.metrics.is_some());
        // Reads /proc/self/fd: before Landlock and the filter.
        fds::check_reserve(endpoints);
        // What the filter needs done first reads files Landlock then denies.
        seccomp::prepare(self.args.seccomp);
        // Landlock, then the filter, which has no Landlock syscalls.
        landlock::restrict(
            self.args.landlock,
            self.profile,
            std::mem::take(&mut self.sandbox),
        )?;
        seccomp::install(
            self.args.seccomp,
            self.profile,
            self.extras,
            &self.unlink_dirs,
            self.open_dir,
        )?;
        if self.args.seccomp != args::SeccompMode::Off {
            connector::filter_installed();
        }
        // The socket has been listening since start-up; connections queue
        // in its backlog until the first accept, which comes next.
        self.notifier.notify("READY=1");
        loop {
            match self.connection(&engines) {
                Ok(()) => {}
                Err(ConnectionError::Lost(e)) => {
                    warn_limited!(
                        self.log_limit,
                        "connection failed: {e}; waiting for the next one"
                    )
                }
                Err(ConnectionError::Fatal(e)) => return Err(e),
            }
        }
    }

    /// Serves one front-end. Whatever happens, every worker has drained and
    /// every thread of the connection has been joined when this returns,
    /// and `engines` holds the engines again.
    fn connection<E: Engine + 'static>(
        &mut self,
        engines: &Parked<E>,
    ) -> Result<(), ConnectionError> {
        let (args, device) = (self.args, self.device);
        let replaced = crate::vhost::sigbus::replaced_pages();
        let front = accept(self.listener, &mut self.log_limit)?;
        await_exit_if_stopping(device);
        let workers = std::mem::take(&mut *lock(engines))
            .into_iter()
            .zip(self.metrics.iter().zip(self.timers))
            .enumerate()
            .map(|(i, (core, (m, timer)))| {
                // --cpus pins threads: queue i runs on thread i % threads.
                let thread = i % self.threads;
                let cpu = (!args.cpus.is_empty()).then(|| args.cpus[thread % args.cpus.len()]);
                let (s, m, t) = (self.settings, m.clone(), timer.clone());
                let mut w = QueueWorker::new(device.clone(), s, m, core, t, cpu);
                if let Some(fd) = self.resume.get(i) {
                    w.share_thread(fd.clone());
                }
                w
            })
            .collect();
        device.new_connection();
        let backend = Arc::new(BlkBackend::new(
            device.clone(),
            workers,
            self.threads,
            self.exit_events.clone(),
        ));
        let served = self.run(front, &backend);
        // Every worker stops taking kicks and finishes what it took (again,
        // if `run` did); then the engines come back for the next one.
        backend.drain_all();
        device.set_connection(None);
        device.set_front_end(None);
        let replaced = crate::vhost::sigbus::replaced_pages() - replaced;
        if replaced > 0 {
            log::warn!(
                "the front-end shrank its memory under its own guest: {replaced} page(s) past the end of their file were replaced with zero pages"
            );
        }
        let back = backend.take_cores();
        let parked = {
            let mut engines = lock(engines);
            engines.extend(back);
            engines.len()
        };
        if parked != self.metrics.len() {
            // The signal handler closed them and is ending the process.
            await_exit_if_stopping(device);
            return Err(ConnectionError::Fatal(DaemonError::Vhost(
                "a connection's engines did not come back".into(),
            )));
        }
        if Arc::strong_count(&backend) > 1 {
            // vhost-user-backend leaves the queue threads it had started
            // running when setting up a connection fails half-way; they hold
            // the device, which no longer has workers for them.
            warn_limited!(
                self.log_limit,
                "{} thread(s) of a failed connection could not be stopped",
                Arc::strong_count(&backend) - 1
            );
        }
        served.map_err(|e| match e {
            DaemonError::Inner(_) => ConnectionError::Fatal(e),
            e => ConnectionError::Lost(e),
        })
    }

    /// The connection's vhost-user side: the crate's daemon and its queue
    /// threads, and the relay in front of it. All of them are joined before
    /// this returns.
    fn run<E: Engine + 'static>(
        &mut self,
        front: UnixStream,
        backend: &Arc<BlkBackend<E>>,
    ) -> Result<(), DaemonError> {
        let mem = GuestMemoryAtomic::new(GuestMem::new());
        let hints = crate::vhost::hints::SetupHints::new(self.metrics.to_vec(), mem.clone());
        let mut daemon = VhostUserDaemon::new("ringblk".into(), backend.clone(), mem)
            .map_err(|e| DaemonError::Vhost(e.to_string()))?;
        for (t, h) in daemon.get_epoll_handlers().iter().enumerate() {
            for (local, q) in backend.thread_queues(t).enumerate() {
                for kind in crate::vhost::Listener::ALL {
                    let Some(fd) = backend.listener_fd(q, kind) else {
                        continue;
                    };
                    h.register_listener(fd, EventSet::IN, backend.listener_id(local, kind))
                        .map_err(|e| {
                            DaemonError::Vhost(format!("registering {kind:?} eventfd: {e}"))
                        })?;
                }
            }
        }
        self.device.set_connection(Some(backend.clone()));
        self.device.set_front_end(socket::peer(&front));
        // vhost-user-backend accepts its own connection; give it one end of
        // a private socket and relay the front-end's messages to it.
        let back = self.inner.connect()?;
        daemon
            .start(&mut self.inner.listener)
            .map_err(|e| DaemonError::Vhost(e.to_string()))?;
        let relay = relay::relay(front, back, backend.clone(), hints)
            .map_err(|e| DaemonError::Vhost(format!("relay: {e}")))?;
        log::info!("front-end connected");
        let ended = daemon.wait();
        // Workers stop taking kicks and finish what they took before their
        // threads are told to exit.
        backend.drain_all();
        // Dropping the crate's daemon signals its queue threads and joins
        // them, so none is left running when the next connection reuses the
        // exit events and the engines.
        drop(daemon);
        for t in relay {
            let _ = t.join();
        }
        match ended {
            Ok(())
            | Err(vhost_user_backend::Error::HandleRequest(
                vhost::vhost_user::Error::Disconnected,
            )) => {
                log::info!("front-end disconnected; waiting for the next one");
                Ok(())
            }
            Err(e) => Err(DaemonError::Vhost(format!("connection ended: {e}"))),
        }
    }
}

/// Once SIGINT, SIGTERM or SIGHUP came, the signal handler owns the engines (it
/// closes them) and ends the process: this thread only waits for that.
fn await_exit_if_stopping(device: &Device) {
    while device.stopping() {
        std::thread::park();
    }
}

/// The next front-end. Running out of fds or memory fails this attempt
/// (after a pause, so a flood of them does not spin); the listening socket
/// itself failing is fatal.
fn accept(
    listener: &UnixListener,
    log_limit: &mut RateLimiter,
) -> Result<UnixStream, ConnectionError> {
    loop {
        match listener.accept() {
            Ok((s, _)) => return Ok(s),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionAborted => continue,
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)
                ) =>
            {
                warn_limited!(log_limit, "cannot accept a front-end: {e}");
                std::thread::sleep(Duration::from_millis(100));
                return Err(ConnectionError::Lost(DaemonError::Socket(format!(
                    "accept: {e}"
                ))));
            }
            Err(e) => {
                return Err(ConnectionError::Fatal(DaemonError::Socket(format!(
                    "accept: {e}"
                ))));
            }
        }
    }
}

/// The socket between the relay and vhost-user-backend, in a private
/// directory (mode 0700) so only this user can connect to it. Bound once,
/// before the seccomp filter; each connection accepts on it again. The
/// relay's end of each connection is made by the connector process
/// (`connector`): the daemon itself connects to nothing after start-up.
struct InnerSocket {
    paths: InnerPaths,
    listener: Listener,
    connector: connector::Connector,
}

/// Where the inner socket lives, and its removal on exit.
#[derive(Clone)]
struct InnerPaths {
    #[cfg(test)]
    dir: PathBuf,
    sock: PathBuf,
    removals: [Removal; 2],
}

impl InnerPaths {
    /// Removes the socket and its directory, by directory fd (see
    /// `removal`): no path lookup, no directory walk.
    fn remove(&self) {
        self.removals.iter().for_each(Removal::remove);
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
        let removals = [
            Removal::file(&sock).map_err(err)?,
            Removal::dir(&dir).map_err(err)?,
        ];
        let paths = InnerPaths {
            #[cfg(test)]
            dir: dir.clone(),
            sock,
            removals,
        };
        let connector = match connector::Connector::spawn(&paths.sock) {
            Ok(c) => c,
            Err(e) => {
                paths.remove();
                return Err(DaemonError::Socket(format!("connector process: {e}")));
            }
        };
        Ok(InnerSocket {
            paths,
            listener,
            connector,
        })
    }

    /// The stream the relay writes to; the crate accepts its other end.
    /// A connector that is gone is [`DaemonError::Inner`] (the daemon
    /// cannot go on); anything else fails this connection only.
    fn connect(&self) -> Result<UnixStream, DaemonError> {
        let err = |e: &dyn std::fmt::Display| format!("{}: {e}", self.paths.sock.display());
        self.drop_stale()
            .map_err(|e| DaemonError::Socket(err(&e)))?;
        self.connector.connect().map_err(|e| match e {
            connector::ConnectError::Gone(_) => DaemonError::Inner(err(&e)),
            connector::ConnectError::Failed(_) => DaemonError::Socket(err(&e)),
        })
    }

    /// Removes from the backlog the connections whose stream never reached
    /// the relay (the daemon was out of fds as it came, or the crate could
    /// not accept): the crate would take one of them for the next
    /// front-end's, and every connection after would be paired with the
    /// one before it.
    fn drop_stale(&self) -> std::io::Result<()> {
        let io = |e: vhost::vhost_user::Error| std::io::Error::other(e.to_string());
        self.listener.set_nonblocking(true).map_err(io)?;
        let drained = loop {
            match self.listener.accept() {
                Ok(Some(stale)) => drop(stale),
                Ok(None) => break Ok(()),
                Err(e) => break Err(io(e)),
            }
        };
        self.listener.set_nonblocking(false).map_err(io)?;
        drained
    }
}

impl Drop for InnerSocket {
    fn drop(&mut self) {
        self.paths.remove();
    }
}

/// SIGINT, SIGTERM and SIGHUP, caught from start-up on: one that comes
/// before [`spawn_signal_handler`] waits for it.
struct Signals(signal_hook::iterator::Signals);

impl Signals {
    fn new() -> std::io::Result<Signals> {
        use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
        signal_hook::iterator::Signals::new([SIGINT, SIGTERM, SIGHUP]).map(Signals)
    }
}

/// SIGINT, SIGTERM and SIGHUP (a closed terminal, or a `kill -HUP` that
/// meant "reload": qemu-storage-daemon also stops cleanly on it; there is
/// nothing to reload): stop taking requests, finish what is in flight,
/// make it durable, close what must be closed (`Closer`), remove the
/// socket, exit 0.
fn spawn_signal_handler(
    Signals(mut signals): Signals,
    device: Arc<Device>,
    closer: Closer,
    files: Vec<Removal>,
    inner: InnerPaths,
    notifier: Notifier,
) -> Result<(), DaemonError> {
    std::thread::Builder::new()
        .name("signals".into())
        .spawn(move || {
            if let Some(sig) = signals.forever().next() {
                log::info!("signal {sig}: finishing in-flight requests");
                notifier.notify("STOPPING=1");
                device.stop();
                // A block job's last stretch is committed before the image
                // is made durable below.
                device.stop_job();
                if let Some(c) = device.connection() {
                    c.drain_all();
                }
                // The rings are stopped: a backup ends (as failed), and
                // the bitmaps are written out.
                device.stop_tracking();
                if let Err(e) = device.make_durable() {
                    log::error!("making the image durable failed: {e}");
                }
                // Taken out first: the lock is not held while it runs.
                let close = lock(&closer).take();
                if let Some(close) = close {
                    close();
                    log::info!("image closed");
                }
                // process::exit skips destructors: remove what they would have.
                files.iter().for_each(Removal::remove);
                inner.remove();
                log::info!("stopped");
                std::process::exit(0);
            }
        })
        .map_err(DaemonError::Signals)?;
    Ok(())
}

/// Tells the user what is being served and how to connect.
fn announce(
    socket: &str,
    args: &ServeArgs,
    backing: &config::Backing,
    device: &Device,
    threads: usize,
) {
    if let config::Backing::File {
        image,
        created: true,
        ..
    } = backing
    {
        log::info!(
            "created sparse image {} ({} bytes)",
            image.path.display(),
            image.size
        );
    }
    log::info!(
        "serving {} ({} sectors, {}-byte blocks{}{}) on {} with {} queue(s) of {}, serial {}",
        backing.name(),
        device.capacity(),
        device.limits().block_size,
        if args.readonly { ", read-only" } else { "" },
        if args.direct { ", O_DIRECT" } else { "" },
        socket,
        args.queues,
        args.queue_size,
        String::from_utf8_lossy(device.serial()).trim_end_matches('\0'),
    );
    log::debug!(
        "{} queue(s) on {threads} worker thread(s){}",
        args.queues,
        if threads < usize::from(args.queues) {
            " that take turns and do not busy-poll"
        } else {
            ""
        }
    );
    // Absolute, so that the line works from any directory; reconnect=1,
    // so that QEMU reconnects to a restarted daemon (an upgrade) and the
    // guest sees nothing (inflight tracking resubmits what was taken).
    let path = std::path::absolute(socket)
        .map(|p| p.display().to_string())
        .unwrap_or_else(|_| socket.to_string());
    // Written, not println!: a closed stdout must not stop the daemon.
    let _ = writeln!(
        std::io::stdout(),
        "Connect QEMU with:\n  qemu-system-x86_64 -m 1G -object memory-backend-memfd,id=mem,size=1G,share=on \
         -numa node,memdev=mem -chardev socket,id=rb0,path={path},reconnect=1 \
         -device vhost-user-blk-pci,chardev=rb0,num-queues={} ...",
        args.queues
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two inner sockets of one process (one pid) must not share, or
    /// remove, each other's directory: the name is not derived from the
    /// pid, which a later daemon of another user may get again.
    /// A stream the connector made that never reached the relay is not
    /// what the crate accepts for the next front-end: each accept gets the
    /// relay's own stream.
    #[test]
    fn a_stale_inner_connection_is_not_paired_with_the_next_front_end() {
        use std::io::{Read, Write};
        let inner = InnerSocket::new().expect("inner socket");
        // As if the daemon had run out of fds as the stream came.
        drop(inner.connector.connect().expect("a stream"));
        for i in 0..3u8 {
            let mut ours = inner.connect().expect("connects");
            ours.write_all(&[i]).unwrap();
            let mut theirs = inner.listener.accept().unwrap().expect("accepted");
            let mut got = [0u8];
            theirs.read_exact(&mut got).expect("the relay's own stream");
            assert_eq!(got, [i]);
        }
    }

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
