//! A safe wrapper over the few librados/librbd calls the RBD engine makes
//! (`rbd-sys`). Each handle owns its C object and releases it on drop; the
//! asynchronous calls stay `unsafe fn`s whose contract is the lifetime of
//! the guest buffers.
//!
//! Errors carry librados/librbd's negative errno, turned into a one-line
//! message that says what to check.

use std::ffi::{CString, c_void};
use std::os::fd::RawFd;
use std::path::Path;
use std::ptr;
use std::sync::Arc;
use std::time::Duration;

use rbd_sys as sys;

/// Why the cluster, the pool or the image cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum RbdError {
    #[error("{what}: {}", std::io::Error::from_raw_os_error(*.errno))]
    Call { what: String, errno: i32 },
    #[error(
        "no Ceph cluster answered within {0} s (mon host in {1}); is it running and reachable?"
    )]
    Unreachable(u64, String),
    #[error("permission denied by the cluster for client.{id} ({what}); check its key and caps")]
    Denied { id: String, what: String },
    /// cephx refused us at connect: a key the cluster does not know.
    #[error(
        "permission denied by the cluster for client.{0}: authentication failed (a wrong key, or no such user); check the keyring {1} names"
    )]
    AuthFailed(String, String),
    /// librados found no monitor to ask, or no key to ask with.
    #[error("{1} names no monitor (mon host), or no keyring holding a key for client.{0}")]
    NotConfigured(String, String),
    #[error("no pool '{0}' in the cluster")]
    NoPool(String),
    #[error("no image '{1}' in pool '{0}'")]
    NoImage(String, String),
    #[error("{0} contains a NUL byte")]
    Nul(&'static str),
}

fn cstring(s: &str, what: &'static str) -> Result<CString, RbdError> {
    CString::new(s).map_err(|_| RbdError::Nul(what))
}

/// A connected librados client (`rados_t`). Shut down on drop, after every
/// pool context and image made from it (they hold an `Arc` of it).
#[derive(Debug)]
pub struct Cluster {
    h: sys::rados_t,
    id: String,
}

// SAFETY: a rados_t may be used from any thread (librados is thread-safe:
// its calls lock internally); the handle is only a pointer to that state.
unsafe impl Send for Cluster {}
// SAFETY: as for Send: concurrent librados calls on one rados_t are
// allowed.
unsafe impl Sync for Cluster {}

impl Cluster {
    /// Connects as `client.{id}` with the configuration at `conf`, giving
    /// up after `timeout` (connection, and every later monitor and OSD
    /// operation: a stopped cluster fails I/O instead of hanging it).
    pub fn connect(conf: &Path, id: &str, timeout: Duration) -> Result<Arc<Cluster>, RbdError> {
        let c_id = cstring(id, "--ceph-id")?;
        let mut h: sys::rados_t = ptr::null_mut();
        // SAFETY: `h` is a valid out-pointer; `c_id` is a NUL-terminated
        // string that librados copies.
        check("creating a Ceph client", unsafe {
            sys::rados_create(&mut h, c_id.as_ptr())
        })?;
        // Owned from here: dropped (rados_shutdown) on any error below.
        let cluster = Cluster { h, id: id.into() };
        let conf_str = conf.to_string_lossy();
        let c_conf = cstring(&conf_str, "--ceph-conf")?;
        // SAFETY: `h` was created above and is not connected yet;
        // `c_conf` is NUL-terminated and only read during the call.
        check(&format!("reading {conf_str}"), unsafe {
            sys::rados_conf_read_file(h, c_conf.as_ptr())
        })?;
        let secs = timeout.as_secs().max(1).to_string();
        for (key, value) in [
            ("client_mount_timeout", secs.as_str()),
            ("rados_mon_op_timeout", secs.as_str()),
            ("rados_osd_op_timeout", secs.as_str()),
            // Every write librbd acknowledges is on the OSDs already: no
            // client-side write-back cache to lose on kill -9, to flush
            // before a migration, or to keep coherent between two hosts.
            ("rbd_cache", "false"),
            // No admin socket: it would be a control socket into the
            // sandboxed daemon, answered by a thread that accepts and
            // unlinks outside the seccomp profile.
            ("admin_socket", ""),
        ] {
            let (k, v) = (cstring(key, "option")?, cstring(value, "option")?);
            // SAFETY: `h` is valid and not connected; both strings are
            // NUL-terminated and copied by librados.
            check(&format!("setting {key}"), unsafe {
                sys::rados_conf_set(h, k.as_ptr(), v.as_ptr())
            })?;
        }
        // SAFETY: `h` is valid and configured; connect blocks for at most
        // client_mount_timeout.
        let r = unsafe { sys::rados_connect(h) };
        match -r {
            0 => Ok(Arc::new(cluster)),
            libc::ETIMEDOUT | libc::ENOTCONN | libc::ECONNREFUSED => {
                Err(RbdError::Unreachable(timeout.as_secs(), conf_str.into()))
            }
            libc::EACCES | libc::EPERM => Err(RbdError::AuthFailed(id.into(), conf_str.into())),
            libc::ENOENT => Err(RbdError::NotConfigured(id.into(), conf_str.into())),
            errno => Err(RbdError::Call {
                what: format!("connecting to the Ceph cluster of {conf_str}"),
                errno,
            }),
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // SAFETY: `h` came from rados_create; every ioctx and image made
        // from it holds an Arc of this Cluster, so all are gone by now.
        unsafe { sys::rados_shutdown(self.h) };
    }
}

/// An I/O context on one pool (`rados_ioctx_t`).
#[derive(Debug)]
pub struct Pool {
    h: sys::rados_ioctx_t,
    name: String,
    cluster: Arc<Cluster>,
}

// SAFETY: librados ioctx calls are thread-safe (the ioctx locks its own
// state), and images opened on it may be used from other threads.
unsafe impl Send for Pool {}
// SAFETY: as for Send.
unsafe impl Sync for Pool {}

impl Pool {
    pub fn open(cluster: &Arc<Cluster>, name: &str) -> Result<Arc<Pool>, RbdError> {
        let c_name = cstring(name, "the pool name")?;
        let mut h: sys::rados_ioctx_t = ptr::null_mut();
        // SAFETY: the cluster is connected; `h` is a valid out-pointer and
        // the name is NUL-terminated.
        let r = unsafe { sys::rados_ioctx_create(cluster.h, c_name.as_ptr(), &mut h) };
        match -r {
            0 => Ok(Arc::new(Pool {
                h,
                name: name.into(),
                cluster: cluster.clone(),
            })),
            libc::ENOENT => Err(RbdError::NoPool(name.into())),
            libc::EACCES | libc::EPERM => Err(RbdError::Denied {
                id: cluster.id.clone(),
                what: format!("opening pool '{name}'"),
            }),
            errno => Err(RbdError::Call {
                what: format!("opening pool '{name}'"),
                errno,
            }),
        }
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        // SAFETY: `h` came from rados_ioctx_create; images opened on it hold
        // an Arc of this Pool, so all are closed by now.
        unsafe { sys::rados_ioctx_destroy(self.h) };
    }
}

/// An open RBD image (`rbd_image_t`). Closed on drop; the engine that owns
/// it waits for its I/O first.
#[derive(Debug)]
pub struct Image {
    h: sys::rbd_image_t,
    _pool: Arc<Pool>,
}

// SAFETY: librbd image handles are thread-safe (an image context locks its
// own state); each engine uses its handle from its queue's thread only.
unsafe impl Send for Image {}

impl Image {
    pub fn open(pool: &Arc<Pool>, name: &str, readonly: bool) -> Result<Image, RbdError> {
        let c_name = cstring(name, "the image name")?;
        let mut h: sys::rbd_image_t = ptr::null_mut();
        // SAFETY: the pool's ioctx is valid; `h` is a valid out-pointer;
        // the name is NUL-terminated; a NULL snapshot name means the head.
        let r = unsafe {
            if readonly {
                sys::rbd_open_read_only(pool.h, c_name.as_ptr(), &mut h, ptr::null())
            } else {
                sys::rbd_open(pool.h, c_name.as_ptr(), &mut h, ptr::null())
            }
        };
        match -r {
            0 => Ok(Image {
                h,
                _pool: pool.clone(),
            }),
            libc::ENOENT => Err(RbdError::NoImage(pool.name.clone(), name.into())),
            libc::EACCES | libc::EPERM => Err(RbdError::Denied {
                id: pool.cluster.id.clone(),
                what: format!("opening image '{}/{name}'", pool.name),
            }),
            errno => Err(RbdError::Call {
                what: format!("opening image '{}/{name}'", pool.name),
                errno,
            }),
        }
    }

    /// Size in bytes.
    pub fn size(&self) -> Result<u64, RbdError> {
        let mut size = 0u64;
        // SAFETY: the image is open; `size` is a valid out-pointer.
        check("reading the image size", unsafe {
            sys::rbd_get_size(self.h, &mut size)
        })?;
        Ok(size)
    }

    /// The image's id in its pool: the same on every host, unlike its
    /// name, which may be renamed.
    pub fn id(&self) -> Result<String, RbdError> {
        let mut buf = [0u8; 64];
        // SAFETY: the image is open; librbd writes at most `buf.len()`
        // bytes, NUL included, into `buf`.
        check("reading the image id", unsafe {
            sys::rbd_get_id(self.h, buf.as_mut_ptr().cast(), buf.len())
        })?;
        let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
        Ok(String::from_utf8_lossy(&buf[..end]).into_owned())
    }

    /// The image's feature bits (`RBD_FEATURE_*`).
    pub fn features(&self) -> Result<u64, RbdError> {
        let mut f = 0u64;
        // SAFETY: the image is open; `f` is a valid out-pointer.
        check("reading the image features", unsafe {
            sys::rbd_get_features(self.h, &mut f)
        })?;
        Ok(f)
    }

    /// librbd writes to `fd` (an eventfd) each time an I/O of this handle
    /// completes, and queues the completion for [`Image::poll_events`].
    pub fn notify_eventfd(&self, fd: RawFd) -> Result<(), RbdError> {
        // SAFETY: the image is open; librbd keeps the fd number and writes
        // to it; the engine keeps the eventfd open for the image's life.
        check("setting the completion eventfd", unsafe {
            sys::rbd_set_image_notification(self.h, fd, sys::EVENT_TYPE_EVENTFD as i32)
        })
    }

    /// Moves up to `out.len()` completed I/Os into `out`; returns how many.
    pub fn poll_events(&self, out: &mut [sys::rbd_completion_t]) -> usize {
        let n = i32::try_from(out.len()).unwrap_or(i32::MAX);
        // SAFETY: `out` holds at least `n` writable completion slots.
        let r = unsafe { sys::rbd_poll_io_events(self.h, out.as_mut_ptr(), n) };
        usize::try_from(r).unwrap_or(0)
    }

    /// Flushes and waits (blocking).
    pub fn flush(&self) -> Result<(), RbdError> {
        // SAFETY: the image is open; the call takes no buffers.
        check("flushing the image", unsafe { sys::rbd_flush(self.h) })
    }

    /// Starts a read into `iov[..n]` at `off`.
    ///
    /// # Safety
    /// The iovec array and every buffer it describes must stay valid and
    /// writable, and not move, until `c` completes.
    pub unsafe fn aio_readv(&self, iov: *const libc::iovec, n: i32, off: u64, c: &Aio) -> i32 {
        // SAFETY: the caller keeps the buffers valid until completion;
        // rbd-sys's iovec is libc's (same C struct).
        unsafe { sys::rbd_aio_readv(self.h, iov.cast(), n, off, c.h) }
    }

    /// Starts a write of `iov[..n]` at `off`.
    ///
    /// # Safety
    /// As for [`Image::aio_readv`], readable rather than writable.
    pub unsafe fn aio_writev(&self, iov: *const libc::iovec, n: i32, off: u64, c: &Aio) -> i32 {
        // SAFETY: the caller keeps the buffers valid until completion.
        unsafe { sys::rbd_aio_writev(self.h, iov.cast(), n, off, c.h) }
    }

    pub fn aio_flush(&self, c: &Aio) -> i32 {
        // SAFETY: the image is open and `c` unused; no buffers.
        unsafe { sys::rbd_aio_flush(self.h, c.h) }
    }

    pub fn aio_discard(&self, off: u64, len: u64, c: &Aio) -> i32 {
        // SAFETY: the image is open and `c` unused; no buffers.
        unsafe { sys::rbd_aio_discard(self.h, off, len, c.h) }
    }

    /// Zeroes `len` bytes at `off`; `thick`: keep them allocated.
    pub fn aio_write_zeroes(&self, off: u64, len: u64, thick: bool, c: &Aio) -> i32 {
        let Ok(len) = usize::try_from(len) else {
            return -libc::EINVAL;
        };
        let flags = if thick {
            sys::RBD_WRITE_ZEROES_FLAG_THICK_PROVISION as i32
        } else {
            0
        };
        // SAFETY: the image is open and `c` unused; no buffers.
        unsafe { sys::rbd_aio_write_zeroes(self.h, off, len, c.h, flags, 0) }
    }
}

impl Drop for Image {
    fn drop(&mut self) {
        // SAFETY: `h` came from rbd_open; the owning engine has waited for
        // every I/O it started on it.
        let r = unsafe { sys::rbd_close(self.h) };
        if r < 0 {
            log::warn!(
                "closing the RBD image: {}",
                std::io::Error::from_raw_os_error(-r)
            );
        }
    }
}

/// One asynchronous operation's completion (`rbd_completion_t`), tagged
/// with a key the engine gets back from [`Image::poll_events`].
#[derive(Debug)]
pub struct Aio {
    h: sys::rbd_completion_t,
}

impl Aio {
    /// A completion tagged `key`, with no callback: completions are only
    /// collected through the image's eventfd.
    pub fn new(key: usize) -> Result<Aio, RbdError> {
        let mut h: sys::rbd_completion_t = ptr::null_mut();
        // SAFETY: `h` is a valid out-pointer; the argument is an integer
        // carried as a pointer and never dereferenced; no callback.
        check("creating a completion", unsafe {
            sys::rbd_aio_create_completion(key as *mut c_void, None, &mut h)
        })?;
        Ok(Aio { h })
    }

    /// Whether `raw` (from [`Image::poll_events`]) is this completion.
    pub fn is(&self, raw: sys::rbd_completion_t) -> bool {
        self.h == raw
    }

    /// The operation's result: bytes for a read or write, 0, or -errno.
    pub fn result(&self) -> isize {
        // SAFETY: `h` is a live completion.
        let r = unsafe { sys::rbd_aio_get_return_value(self.h) };
        r as isize
    }

    /// Blocks until the operation completes.
    pub fn wait(&self) {
        // SAFETY: `h` is a live completion.
        unsafe { sys::rbd_aio_wait_for_complete(self.h) };
    }
}

/// The key a raw completion from [`Image::poll_events`] was tagged with.
///
/// # Safety
/// `raw` must be a completion [`Image::poll_events`] returned, whose
/// [`Aio`] has not been dropped (released) yet.
pub unsafe fn key_of(raw: sys::rbd_completion_t) -> usize {
    // SAFETY: the caller passes a live completion; its argument is the
    // integer `Aio::new` stored, read back without being dereferenced.
    unsafe { sys::rbd_aio_get_arg(raw) as usize }
}

impl Drop for Aio {
    fn drop(&mut self) {
        // SAFETY: the engine drops an `Aio` only once its operation has
        // completed (reaped, waited for, or never started), and librbd
        // keeps its own reference while the operation runs.
        unsafe { sys::rbd_aio_release(self.h) };
    }
}

// SAFETY: a completion handle may be released and queried from any
// thread; it moves with its engine to the queue's thread.
unsafe impl Send for Aio {}

pub use sys::RBD_FEATURE_EXCLUSIVE_LOCK;
pub use sys::rbd_completion_t as RawCompletion;

fn check(what: &str, r: i32) -> Result<(), RbdError> {
    if r < 0 {
        Err(RbdError::Call {
            what: what.into(),
            errno: -r,
        })
    } else {
        Ok(())
    }
}
