//! A safe wrapper over the few librados/librbd calls the RBD engine makes
//! (`rbd-sys`). Each handle owns its C object and releases it on drop; the
//! asynchronous calls stay `unsafe fn`s whose contract is the lifetime of
//! the guest buffers.
//!
//! Completions come back through librbd's completion callback, which runs
//! on one of librbd's threads and only hands the operation's key to the
//! [`CompletionList`] its [`Aio`] names: one list per queue, so queues
//! can share one image handle.
//!
//! Errors carry librados/librbd's negative errno, turned into a one-line
//! message that says what to check.

use std::ffi::{CString, c_void};
use std::os::fd::{AsRawFd, RawFd};
use std::path::Path;
use std::ptr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use rbd_sys as sys;
use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

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

/// An open RBD image (`rbd_image_t`), shared by every queue's engine (an
/// `Arc`). Closed on drop, when the last engine is gone; each engine waits
/// for its own I/O first.
#[derive(Debug)]
pub struct Image {
    h: sys::rbd_image_t,
    _pool: Arc<Pool>,
}

// SAFETY: librbd image handles are thread-safe: an ImageCtx guards its
// state with its own locks, and librbd's C API may be called on one handle
// from several threads at once (QEMU's multi-queue rbd driver and SPDK's
// bdev_rbd do so).
unsafe impl Send for Image {}
// SAFETY: as for Send: every method takes `&self` and is one librbd call
// on the handle, which librbd serializes where it must.
unsafe impl Sync for Image {}

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

    /// Resizes the image to `size` bytes, growing or shrinking it, and
    /// waits (synchronous: for the control API's thread, never a
    /// worker's). Later I/O on this handle sees the new size.
    pub fn resize(&self, size: u64) -> Result<(), RbdError> {
        // SAFETY: the image is open; the call takes no buffers.
        check("resizing the image", unsafe {
            sys::rbd_resize(self.h, size)
        })
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

/// Where one queue's completions go. librbd's callback (on one of its own
/// threads) appends the operation's [`Done`] and writes the eventfd when
/// the list was empty: one wake-up for a burst of completions, where
/// librbd's image notification wrote the eventfd once per I/O. The queue's
/// worker watches the eventfd and takes the whole list ([`Self::take`]).
#[derive(Debug)]
pub struct CompletionList {
    done: Mutex<Vec<Done>>,
    eventfd: EventFd,
}

/// A finished operation: the key its [`Aio`] was tagged with, and which
/// completion it was (checked against the slot's, see [`Aio::is`]).
#[derive(Clone, Copy, Debug)]
pub struct Done {
    pub key: usize,
    handle: usize,
}

impl CompletionList {
    /// A list with room for `capacity` completions without allocating
    /// (the engine never has more in flight).
    pub fn new(capacity: usize) -> Result<Arc<CompletionList>, RbdError> {
        let eventfd = EventFd::new(EFD_NONBLOCK).map_err(|e| RbdError::Call {
            what: "creating an eventfd".into(),
            errno: e.raw_os_error().unwrap_or(libc::EIO),
        })?;
        Ok(Arc::new(CompletionList {
            done: Mutex::new(Vec::with_capacity(capacity)),
            eventfd,
        }))
    }

    /// The eventfd written when the list becomes non-empty.
    pub fn fd(&self) -> RawFd {
        self.eventfd.as_raw_fd()
    }

    /// Consumes the eventfd's count.
    pub fn clear_fd(&self) {
        let _ = self.eventfd.read();
    }

    /// Whether a completion is waiting to be taken.
    pub fn is_empty(&self) -> bool {
        self.lock().is_empty()
    }

    /// Swaps the list's contents with `into` (which must be empty): the
    /// list keeps `into`'s allocation, so neither side allocates.
    pub fn take(&self, into: &mut Vec<Done>) {
        debug_assert!(into.is_empty());
        std::mem::swap(&mut *self.lock(), into);
    }

    /// A poisoned lock is taken as it is: nothing that holds it can panic
    /// between two consistent states (a push or a swap).
    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Done>> {
        self.done.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// On librbd's thread: appends `done`, and wakes the worker when the
    /// list was empty. A worker that takes the list between the push and
    /// the write only gets a spurious wake-up; one that takes it before
    /// the push leaves it empty, so this push writes.
    fn push(&self, done: Done) {
        let mut list = self.lock();
        let was_empty = list.is_empty();
        list.push(done);
        drop(list);
        if was_empty {
            // Cannot fail but on overflow of the count (2^64 - 2 writes
            // unread), which would still leave the eventfd readable.
            let _ = self.eventfd.write(1);
        }
    }
}

/// What librbd's callback gets as its argument: which operation, and
/// whose list. Owned by its [`Aio`] (a raw `Box`, freed on drop).
struct Tag {
    key: usize,
    list: Arc<CompletionList>,
}

/// librbd's completion callback, run once per operation on one of
/// librbd's threads (or the submitter's, when librbd fails an operation
/// at once).
///
/// It cannot panic, so nothing unwinds into librbd: it copies two fields,
/// clones an `Arc` (which aborts, not panics, on overflow), locks a mutex
/// no one holds across a call that could re-enter it (poisoning is
/// ignored), pushes onto a `Vec` whose capacity already covers every
/// operation in flight, and writes an eventfd ignoring the result.
///
/// # Safety
/// `arg` must be the live `Tag` of the operation's [`Aio`]: only librbd
/// calls it, with the argument [`Aio::new`] gave it.
unsafe extern "C" fn on_complete(c: sys::rbd_completion_t, arg: *mut c_void) {
    let tag = arg.cast::<Tag>().cast_const();
    // SAFETY: `arg` is the `Tag` that `Aio::new` leaked for this
    // completion. It is freed only when the `Aio` is dropped, which is
    // after the `Done` pushed below has been taken by the worker (`reap`)
    // or after `rbd_aio_wait_for_complete`, which returns once this
    // callback has returned (`Drop` of the engine): so it is live while
    // these two fields are read. From the push on, `tag` may be freed and
    // only the callback's own clone of the list is used.
    let (key, list) = unsafe { ((*tag).key, Arc::clone(&(*tag).list)) };
    list.push(Done {
        key,
        handle: c as usize,
    });
}

/// One asynchronous operation's completion (`rbd_completion_t`), tagged
/// with a key that librbd's callback pushes onto a [`CompletionList`].
#[derive(Debug)]
pub struct Aio {
    h: sys::rbd_completion_t,
    /// The callback's argument (a leaked `Box<Tag>`), freed on drop.
    tag: *mut Tag,
}

impl Aio {
    /// A completion tagged `key` whose callback pushes onto `list`.
    pub fn new(key: usize, list: &Arc<CompletionList>) -> Result<Aio, RbdError> {
        let tag = Box::into_raw(Box::new(Tag {
            key,
            list: Arc::clone(list),
        }));
        let mut h: sys::rbd_completion_t = ptr::null_mut();
        // SAFETY: `h` is a valid out-pointer; `tag` stays allocated until
        // the `Aio` is dropped, which the engine does only once the
        // operation has completed (and the callback returned) or was
        // never started; `on_complete` matches `rbd_callback_t`.
        let r = unsafe { sys::rbd_aio_create_completion(tag.cast(), Some(on_complete), &mut h) };
        if let Err(e) = check("creating a completion", r) {
            // SAFETY: `tag` came from Box::into_raw above, and librbd has
            // no completion that could call back with it.
            drop(unsafe { Box::from_raw(tag) });
            return Err(e);
        }
        Ok(Aio { h, tag })
    }

    /// Whether `done` (from [`CompletionList::take`]) is this completion.
    pub fn is(&self, done: &Done) -> bool {
        self.h as usize == done.handle
    }

    /// The operation's result: bytes for a read or write, 0, or -errno.
    pub fn result(&self) -> isize {
        // SAFETY: `h` is a live completion.
        let r = unsafe { sys::rbd_aio_get_return_value(self.h) };
        r as isize
    }

    /// Blocks until the operation completes (and its callback returned).
    pub fn wait(&self) {
        // SAFETY: `h` is a live completion.
        unsafe { sys::rbd_aio_wait_for_complete(self.h) };
    }
}

impl Drop for Aio {
    fn drop(&mut self) {
        // SAFETY: the engine drops an `Aio` only once its operation has
        // completed (its `Done` taken, or waited for) or was never
        // started, and librbd keeps its own reference to the completion
        // while its callback runs.
        unsafe { sys::rbd_aio_release(self.h) };
        // SAFETY: `tag` came from Box::into_raw in `Aio::new` and is freed
        // only here; the callback no longer reads it (see `on_complete`).
        drop(unsafe { Box::from_raw(self.tag) });
    }
}

// SAFETY: a completion handle may be released and queried from any
// thread; the tag is only read by the callback (see `on_complete`) and
// freed by the owner. It moves with its engine to the queue's thread.
unsafe impl Send for Aio {}

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
