//! A relay between the front-end's connection and vhost-user-backend's,
//! which answers the two messages the crate does not implement:
//! GET_INFLIGHT_FD and SET_INFLIGHT_FD, and one it implements unsafely:
//! SET_LOG_BASE (see `virtio::dirty`); and refuses the SET_VRING_NUM the
//! crate would acknowledge without applying. Everything else, fds
//! included, passes through untouched, so the rest of the protocol stays
//! the crate's.
//!
//! It also signals a ring's call eventfd once when the ring is started and
//! has one (see [`RingCalls`]), as libvhost-user does, so that used
//! elements a previous daemon published but never signalled reach the
//! guest without waiting for its next request; and it refuses an
//! ADD_MEM_REG beyond the memory slots we advertise, which the crate would
//! take (see [`MemSlots`]).
//!
//! Request codes and payloads are the `vhost` crate's types
//! ([`FrontendReq`], [`VhostUserInflight`], ...); the 12-byte header is
//! [`wire`]'s, because the crate keeps its header type private. The
//! back-end request channel ([`channel`]) and the set-up hints
//! (`super::hints`) live beside the relay.
//!
//! Only control messages cross it; the data path is shared memory and
//! eventfds, so the relay costs nothing per I/O.

use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use vhost::vhost_user::message::{
    FrontendReq, VhostUserInflight, VhostUserLog, VhostUserMemory, VhostUserProtocolFeatures,
    VhostUserU64, VhostUserVringState,
};
use vm_memory::ByteValued;
use vmm_sys_util::sock_ctrl_msg::ScmSocket;

pub mod channel;
pub mod wire;

use self::channel::BackendChannel;
use self::wire::{HEADER_LEN, Header, payload_as};
use super::hints::SetupHints;
use super::sigbus::MEM_SLOTS;
use crate::metrics::SharedRateLimiter;
use crate::queue::inflight::InflightRegion;
use crate::virtio::LogRegion;
use crate::{info_limited, log_limited, warn_limited};

/// Larger than any message the protocol defines; a front-end announcing
/// more is broken or hostile and is disconnected.
const MAX_PAYLOAD: usize = 64 * 1024;
/// vhost-user allows at most 8 fds per message.
const MAX_FDS: usize = 8;
/// SET_VRING_KICK / SET_VRING_CALL payload: the ring index in bits 0-7,
/// and bit 8 set when no fd comes with it (vhost-user spec).
const VRING_IDX_MASK: u64 = 0xff;
const VRING_NOFD: u64 = 0x100;

/// Every line the relay logs is one a front-end can repeat at will, on
/// every message or on every new connection; each kind has a limit of its
/// own, kept across connections.
/// (A connection logs at most one of the lines about its end.)
static DISCONNECTS: SharedRateLimiter = limiter();
static GET_INFLIGHT: SharedRateLimiter = limiter();
static GET_INFLIGHT_REFUSED: SharedRateLimiter = limiter();
static SET_INFLIGHT: SharedRateLimiter = limiter();
static SET_INFLIGHT_REFUSED: SharedRateLimiter = limiter();
static SET_LOG_BASE: SharedRateLimiter = limiter();

const fn limiter() -> SharedRateLimiter {
    SharedRateLimiter::new(10, Duration::from_secs(5))
}

/// Where the relay gets and puts inflight regions, the back-end request
/// channel and the dirty-page log: the device.
pub trait InflightHost: Send + Sync + 'static {
    /// The device's queue count and maximum queue size.
    fn limits(&self) -> (u16, u16);
    /// Installs the region for the workers.
    fn set_inflight(&self, region: Arc<InflightRegion>);
    /// Keeps the back-end request channel the front-end handed over.
    fn set_backend_channel(&self, channel: BackendChannel);
    /// Points guest memory, now and in every later table, at the
    /// front-end's dirty-page log.
    fn set_log(&self, log: LogRegion);
    /// The connection is over: from now on no ring takes a new request
    /// (what was taken completes). Called before anything else when either
    /// side's stream ends.
    fn close_intake(&self);
}

struct Msg {
    request: u32,
    flags: u32,
    payload: Vec<u8>,
    fds: Vec<File>,
}

impl Msg {
    fn code(&self) -> Option<FrontendReq> {
        FrontendReq::try_from(self.request).ok()
    }

    fn header(&self) -> Header {
        Header::new(self.request, self.flags, self.payload.len())
    }

    fn needs_reply(&self) -> bool {
        self.header().needs_reply()
    }

    fn send(&self, to: &UnixStream) -> io::Result<()> {
        let hdr = self.header().to_bytes();
        let fds: Vec<RawFd> = self.fds.iter().map(|f| f.as_raw_fd()).collect();
        send_all(to, &hdr, &self.payload, &fds)
    }
}

fn send_all(to: &UnixStream, hdr: &[u8], payload: &[u8], fds: &[RawFd]) -> io::Result<()> {
    let mut buf = Vec::with_capacity(hdr.len() + payload.len());
    buf.extend_from_slice(hdr);
    buf.extend_from_slice(payload);
    let mut sent = to
        .send_with_fds(&[&buf[..]], fds)
        .map_err(io::Error::from)?;
    while sent < buf.len() {
        let n = to
            .send_with_fds(&[&buf[sent..]], &[])
            .map_err(io::Error::from)?;
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        sent += n;
    }
    Ok(())
}

/// How long a front-end may take to send its first message after it
/// connects (QEMU and libblkio send one at once), and to finish a message
/// it has begun. Between messages it may stay silent as long as it likes: a
/// running VM sends none for days. Without these, a client that connects
/// and says nothing, or stops mid-message, would hold the daemon's only
/// connection forever.
const FIRST_MESSAGE: Duration = Duration::from_secs(5);
const REST_OF_MESSAGE: Duration = Duration::from_secs(5);

/// Time limits for reading one message (`None`: none).
#[derive(Clone, Copy)]
struct Limits {
    /// For its first bytes.
    start: Option<Duration>,
    /// For the rest, once it has begun.
    rest: Option<Duration>,
}

/// What the crate's side gets: it is ours.
const TRUSTED: Limits = Limits {
    start: None,
    rest: None,
};

/// Reads one message; `None` at a clean end of stream. A limit that runs
/// out is an error: `WouldBlock` before the message began, `TimedOut` in
/// its middle.
fn read_msg(from: &UnixStream, limits: Limits) -> io::Result<Option<Msg>> {
    let timed = limits.start.is_some() || limits.rest.is_some();
    if timed {
        from.set_read_timeout(limits.start)?;
    }
    let mut hdr = [0u8; HEADER_LEN];
    let mut fds = [-1 as RawFd; MAX_FDS];
    let mut iov = [libc::iovec {
        iov_base: hdr.as_mut_ptr().cast(),
        iov_len: HEADER_LEN,
    }];
    // A read timeout makes the kernel answer EINTR, not restart the call,
    // when a signal or a stop and continue (SIGSTOP, a debugger, the
    // cgroup freezer) comes while it waits: that is no reason to end the
    // connection.
    let (n, nfds) = loop {
        // SAFETY: the iovec points at `hdr`, which outlives the call; `fds`
        // has room for MAX_FDS descriptors.
        match unsafe { from.recv_with_fds(&mut iov, &mut fds) }.map_err(io::Error::from) {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            r => break r?,
        }
    };
    // SAFETY: the kernel installed `nfds` new descriptors we now own.
    let files: Vec<File> = fds[..nfds]
        .iter()
        .map(|fd| unsafe { File::from_raw_fd(*fd) })
        .collect();
    if n == 0 {
        return Ok(None);
    }
    if timed {
        from.set_read_timeout(limits.rest)?;
    }
    let stalled = |e: io::Error| match e.kind() {
        io::ErrorKind::WouldBlock => io::Error::from(io::ErrorKind::TimedOut),
        _ => e,
    };
    (&*from).read_exact(&mut hdr[n..]).map_err(stalled)?;
    let Header {
        request,
        flags,
        size,
    } = Header::from_bytes(&hdr);
    let size = size as usize;
    if size > MAX_PAYLOAD {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("message of {size} bytes"),
        ));
    }
    let mut payload = vec![0u8; size];
    (&*from).read_exact(&mut payload).map_err(stalled)?;
    Ok(Some(Msg {
        request,
        flags,
        payload,
        fds: files,
    }))
}

/// Relays `front` <-> `back` until either side closes; `hints` follows the
/// front-end's messages for set-up mistakes to explain.
pub fn relay(
    front: UnixStream,
    back: UnixStream,
    host: Arc<dyn InflightHost>,
    mut hints: SetupHints,
) -> io::Result<Vec<JoinHandle<()>>> {
    let front_w = Arc::new(Mutex::new(front.try_clone()?));
    let (front_r, back_w, back_r) = (front.try_clone()?, back.try_clone()?, back);
    // Either direction ending ends both, so neither thread outlives the
    // connection and the crate's handler sees the disconnect. First of
    // all, the rings stop taking requests: the drain starts only once the
    // crate's side has wound down, and until then a guest (or whoever
    // else can write the shared rings) could still have requests executed
    // for a front-end that is gone.
    let ends = Arc::new((front.try_clone()?, back_w.try_clone()?, host.clone()));
    let ends2 = ends.clone();
    let shut = move || {
        ends.2.close_intake();
        let _ = ends.0.shutdown(std::net::Shutdown::Both);
        let _ = ends.1.shutdown(std::net::Shutdown::Both);
    };
    let shut2 = move || {
        ends2.2.close_intake();
        let _ = ends2.0.shutdown(std::net::Shutdown::Both);
        let _ = ends2.1.shutdown(std::net::Shutdown::Both);
    };
    let fw = front_w.clone();
    let mut calls = RingCalls::new(usize::from(host.limits().0));
    let mut limits = Limits {
        start: Some(FIRST_MESSAGE),
        rest: Some(REST_OF_MESSAGE),
    };
    let mut slots = MemSlots::default();
    let mut negotiated = Negotiated::default();
    let to_back = std::thread::Builder::new()
        .name("vu-relay-in".into())
        .spawn(move || {
            let mut first = true;
            loop {
                if !first {
                    // Between messages the front-end may be silent as long
                    // as it likes; the hints may want a look meanwhile.
                    limits.start = hints.wait();
                }
                let msg = match read_msg(&front_r, limits) {
                    Ok(Some(m)) => m,
                    Ok(None) => {
                        hints.hung_up();
                        break;
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock && !first => {
                        hints.check();
                        continue;
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        warn_limited!(
                            DISCONNECTS,
                            "front-end sent nothing within the first message's time limit; disconnecting"
                        );
                        break;
                    }
                    Err(e) if e.kind() == io::ErrorKind::TimedOut => {
                        warn_limited!(
                            DISCONNECTS,
                            "front-end stopped in the middle of a message; disconnecting"
                        );
                        break;
                    }
                    Err(e) => {
                        warn_limited!(DISCONNECTS, "front-end message: {e}; disconnecting");
                        break;
                    }
                };
                first = false;
                log::debug!(
                    "front-end request {} ({} bytes, {} fds)",
                    msg.request,
                    msg.payload.len(),
                    msg.fds.len()
                );
                if let Some(code) = msg.code() {
                    hints.follow(code, &msg.payload);
                }
                let r = match msg.code() {
                    Some(FrontendReq::GET_INFLIGHT_FD) => get_inflight(&msg, &*host, &fw),
                    Some(FrontendReq::SET_INFLIGHT_FD) => set_inflight(msg, &*host, &fw),
                    Some(FrontendReq::SET_LOG_BASE) => {
                        match set_log_base(&msg, &*host, &negotiated) {
                            // With LOG_SHMFD the back-end always answers,
                            // with the message's own payload (as the
                            // crate does; QEMU checks the request code).
                            Ok(log) => reply(&fw, msg.request, log.as_slice(), &[]),
                            Err(e) => {
                                warn_limited!(
                                    DISCONNECTS,
                                    "SET_LOG_BASE refused: {e}; disconnecting"
                                );
                                let _ = refuse(&msg, &fw);
                                break;
                            }
                        }
                    }
                    Some(FrontendReq::ADD_MEM_REG) if slots.full() => {
                        warn_limited!(
                            DISCONNECTS,
                            "ADD_MEM_REG refused: all {MEM_SLOTS} memory slots in use; disconnecting"
                        );
                        let _ = refuse(&msg, &fw);
                        break;
                    }
                    Some(FrontendReq::SET_VRING_NUM) if !vring_num_ok(&msg.payload) => {
                        // The crate answers an error with a disconnect too.
                        warn_limited!(
                            DISCONNECTS,
                            "SET_VRING_NUM refused: not a power of two; disconnecting"
                        );
                        let _ = refuse(&msg, &fw);
                        break;
                    }
                    code => msg.send(&back_w).map(|()| {
                        if let Some(code) = code {
                            calls.follow(code, &msg);
                            slots.follow(code, &msg);
                            negotiated.follow(code, &msg, &*host);
                        }
                    }),
                };
                if let Err(e) = r {
                    warn_limited!(DISCONNECTS, "relaying to the back-end: {e}");
                    break;
                }
            }
            shut();
        })?;
    let from_back = std::thread::Builder::new()
        .name("vu-relay-out".into())
        .spawn(move || {
            while let Ok(Some(msg)) = read_msg(&back_r, TRUSTED) {
                let w = front_w.lock().unwrap_or_else(|p| p.into_inner());
                if msg.send(&w).is_err() {
                    break;
                }
            }
            shut2();
        })?;
    Ok(vec![to_back, from_back])
}

/// A split virtqueue's size is a power of two. vhost-user-backend checks
/// only 0 and the maximum, and `Queue::set_size` ignores any other bad
/// size with a log line: the front-end would get a success and a device
/// still using the previous size (for a ring laid out for the new one,
/// used elements written past the end of the front-end's used ring).
/// Malformed payloads are left to the crate, which refuses them.
fn vring_num_ok(p: &[u8]) -> bool {
    payload_as::<VhostUserVringState>(p).is_none_or(|s| s.num.is_power_of_two())
}

/// How many regions the crate's memory table holds, followed from the
/// messages the relay passes on.
///
/// vhost-user-backend advertises [`MEM_SLOTS`] slots but takes any number
/// of ADD_MEM_REG, and the SIGBUS protection can watch only so many
/// regions (`sigbus::SLOTS`). The count is exact for as long as the
/// connection lasts: the crate ends the connection on any message it
/// fails, so every message passed on while it lasts has been applied.
#[derive(Default)]
struct MemSlots(usize);

impl MemSlots {
    /// Whether the table has no room for another region.
    fn full(&self) -> bool {
        self.0 >= MEM_SLOTS
    }

    /// Follows `msg`, which the crate has been sent.
    fn follow(&mut self, code: FrontendReq, msg: &Msg) {
        match code {
            FrontendReq::SET_MEM_TABLE => {
                if let Some(m) = payload_as::<VhostUserMemory>(&msg.payload) {
                    self.0 = m.num_regions as usize;
                }
            }
            FrontendReq::ADD_MEM_REG => self.0 += 1,
            FrontendReq::REM_MEM_REG => self.0 = self.0.saturating_sub(1),
            _ => {}
        }
    }
}

/// The protocol features the front-end acked, and the back-end request
/// channel, followed from the messages the relay passes on:
/// SET_PROTOCOL_FEATURES says whether the relay may take SET_LOG_BASE
/// (LOG_SHMFD) and whether REPLY_ACK applies to the channel, and
/// SET_BACKEND_REQ_FD hands the channel over. The crate gets the fd as it
/// came (it checks that BACKEND_REQ was acked, and answers); the device
/// gets a duplicate, to send CONFIG_CHANGE_MSG on after a resize. The
/// crate ends the connection on a message it fails, so one it took was
/// applied.
#[derive(Default)]
struct Negotiated {
    acked: u64,
}

impl Negotiated {
    fn has(&self, feature: VhostUserProtocolFeatures) -> bool {
        self.acked & feature.bits() != 0
    }

    fn follow(&mut self, code: FrontendReq, msg: &Msg, host: &dyn InflightHost) {
        use VhostUserProtocolFeatures as F;
        match code {
            FrontendReq::SET_PROTOCOL_FEATURES => {
                if let Some(v) = payload_as::<VhostUserU64>(&msg.payload) {
                    self.acked = v.value;
                }
            }
            FrontendReq::SET_BACKEND_REQ_FD if self.acked & F::BACKEND_REQ.bits() != 0 => {
                let Some(sock) = msg.fds.first().and_then(|f| f.try_clone().ok()) else {
                    return;
                };
                let reply_ack = self.acked & F::REPLY_ACK.bits() != 0;
                host.set_backend_channel(BackendChannel::new(
                    std::os::unix::net::UnixStream::from(std::os::fd::OwnedFd::from(sock)),
                    reply_ack,
                ));
            }
            _ => {}
        }
    }
}

/// Each ring's call eventfd and whether the ring is started, followed from
/// the messages the relay passes on.
///
/// A daemon can publish used elements and die before it writes the call
/// eventfd. Its successor finds nothing in flight, so without a signal of
/// its own the guest would wait forever for completions already on the
/// used ring. So the relay writes a ring's call eventfd once at the moment
/// the ring has both a call fd and a kick (is started), whichever comes
/// second (QEMU sends SET_VRING_CALL before SET_VRING_KICK), and again
/// whenever a started ring gets a new call fd. A spurious interrupt costs
/// the guest a look at its used ring; drivers must tolerate them.
struct RingCalls(Vec<RingCall>);

#[derive(Default)]
struct RingCall {
    /// SET_VRING_KICK seen, and no GET_VRING_BASE (stop) or reset since.
    started: bool,
    /// Our copy of the call eventfd the crate signals.
    call: Option<File>,
}

impl RingCalls {
    fn new(queues: usize) -> RingCalls {
        RingCalls((0..queues).map(|_| RingCall::default()).collect())
    }

    /// Follows `msg`, which the crate has been sent.
    fn follow(&mut self, code: FrontendReq, msg: &Msg) {
        let vring_fd = || {
            let v = payload_as::<VhostUserU64>(&msg.payload)?.value;
            Some(((v & VRING_IDX_MASK) as usize, v & VRING_NOFD == 0))
        };
        match code {
            FrontendReq::SET_VRING_KICK => {
                if let Some(ring) = vring_fd().and_then(|(i, _)| self.0.get_mut(i)) {
                    ring.started = true;
                    ring.signal("ring started");
                }
            }
            FrontendReq::SET_VRING_CALL => {
                let Some((i, has_fd)) = vring_fd() else {
                    return;
                };
                let Some(ring) = self.0.get_mut(i) else {
                    return;
                };
                ring.call = match (has_fd, msg.fds.first()) {
                    (true, Some(f)) => f.try_clone().ok(),
                    _ => None,
                };
                if ring.started {
                    ring.signal("call eventfd installed");
                }
            }
            FrontendReq::GET_VRING_BASE => {
                let ring = payload_as::<VhostUserVringState>(&msg.payload)
                    .and_then(|s| self.0.get_mut(s.index as usize));
                if let Some(ring) = ring {
                    ring.started = false;
                }
            }
            FrontendReq::RESET_OWNER | FrontendReq::RESET_DEVICE => {
                self.0.iter_mut().for_each(|r| r.started = false);
            }
            _ => {}
        }
    }
}

impl RingCall {
    fn signal(&self, why: &str) {
        if let Some(mut call) = self.call.as_ref() {
            match call.write_all(&1u64.to_ne_bytes()) {
                Ok(()) => log::debug!("{why}: call eventfd signalled once"),
                Err(e) => log::debug!("{why}: call eventfd: {e}"),
            }
        }
    }
}

/// Answers `msg` with an error status if it asked for a reply.
fn refuse(msg: &Msg, to: &Mutex<UnixStream>) -> io::Result<()> {
    if !msg.needs_reply() {
        return Ok(());
    }
    reply(to, msg.request, VhostUserU64::new(1).as_slice(), &[])
}

fn reply(to: &Mutex<UnixStream>, request: u32, payload: &[u8], fds: &[RawFd]) -> io::Result<()> {
    let hdr = Header::reply(request, payload.len()).to_bytes();
    send_all(
        &to.lock().unwrap_or_else(|p| p.into_inner()),
        &hdr,
        payload,
        fds,
    )
}

fn get_inflight(msg: &Msg, host: &dyn InflightHost, to: &Mutex<UnixStream>) -> io::Result<()> {
    let (queues, max_size) = host.limits();
    let region = payload_as::<VhostUserInflight>(&msg.payload)
        .filter(|a| {
            a.num_queues >= 1
                && a.num_queues <= queues
                && a.queue_size.is_power_of_two()
                && a.queue_size <= max_size
        })
        .map(|a| InflightRegion::create(a.num_queues, a.queue_size));
    let request = msg.request;
    match region {
        Some(Ok(r)) => {
            let out = VhostUserInflight::new(r.size() as u64, 0, r.num_queues, r.queue_size);
            // Developer detail: at DEBUG, like every ring start.
            log_limited!(
                log::Level::Debug,
                GET_INFLIGHT,
                "inflight tracking: {} bytes for {} queue(s) of {}",
                r.size(),
                r.num_queues,
                r.queue_size
            );
            reply(to, request, out.as_slice(), &[r.file.as_raw_fd()])
        }
        // mmap_size 0 tells the front-end we could not provide one.
        other => {
            warn_limited!(
                GET_INFLIGHT_REFUSED,
                "GET_INFLIGHT_FD refused: {}",
                match other {
                    Some(Err(e)) => e.to_string(),
                    _ => "bad queue count or size".into(),
                }
            );
            reply(to, request, VhostUserInflight::default().as_slice(), &[])
        }
    }
}

/// SET_LOG_BASE: maps the front-end's log, if it cannot shrink under us
/// (`LogRegion::from_front_end`), and hands it to the device. The crate
/// would map any file at any size, and a mark past the file's end would
/// kill the daemon; it would also log only the regions of the memory table
/// of the moment (see `virtio::dirty`). Returns the message's payload for
/// the answer.
fn set_log_base(
    msg: &Msg,
    host: &dyn InflightHost,
    negotiated: &Negotiated,
) -> io::Result<VhostUserLog> {
    let invalid = |m: &str| io::Error::new(io::ErrorKind::InvalidInput, m.to_string());
    if !negotiated.has(VhostUserProtocolFeatures::LOG_SHMFD) {
        return Err(invalid("LOG_SHMFD was not negotiated"));
    }
    let (Some(log), [file]) = (payload_as::<VhostUserLog>(&msg.payload), &msg.fds[..]) else {
        return Err(invalid("malformed (a log and one fd)"));
    };
    let region = LogRegion::from_front_end(file, log.mmap_size, log.mmap_offset)?;
    info_limited!(
        SET_LOG_BASE,
        "dirty-page log installed: {} bytes, for guest memory up to {:#x}",
        log.mmap_size,
        region.covers()
    );
    host.set_log(region);
    Ok(log)
}

fn set_inflight(mut msg: Msg, host: &dyn InflightHost, to: &Mutex<UnixStream>) -> io::Result<()> {
    // The region's size and layout are checked against the fd in
    // `from_front_end`; its queues must also be ones the device can have
    // (a ring larger than the region is caught when the ring starts).
    let (queues, max_size) = host.limits();
    let result = match (payload_as::<VhostUserInflight>(&msg.payload), msg.fds.len()) {
        (Some(a), 1) if a.num_queues > queues || a.queue_size > max_size => {
            let (n, size) = (a.num_queues, a.queue_size);
            Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "{n} queue(s) of {size}: the device has {queues} queue(s) of at most {max_size}"
                ),
            ))
        }
        (Some(a), 1) => InflightRegion::from_front_end(
            msg.fds.remove(0),
            a.mmap_size,
            a.mmap_offset,
            a.num_queues,
            a.queue_size,
        ),
        _ => Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "malformed SET_INFLIGHT_FD",
        )),
    };
    let ok = match result {
        Ok(region) => {
            log_limited!(
                log::Level::Debug,
                SET_INFLIGHT,
                "inflight region installed ({} queue(s) of {})",
                region.num_queues,
                region.queue_size
            );
            host.set_inflight(Arc::new(region));
            true
        }
        Err(e) => {
            warn_limited!(SET_INFLIGHT_REFUSED, "SET_INFLIGHT_FD refused: {e}");
            false
        }
    };
    if msg.needs_reply() {
        let status = VhostUserU64::new(u64::from(!ok));
        reply(to, msg.request, status.as_slice(), &[])?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::time::Duration;

    use super::*;

    const SET_VRING_NUM: u32 = FrontendReq::SET_VRING_NUM as u32;

    struct NoDevice;

    impl InflightHost for NoDevice {
        fn limits(&self) -> (u16, u16) {
            (1, 256)
        }
        fn set_inflight(&self, _region: Arc<InflightRegion>) {}
        fn set_backend_channel(&self, _channel: BackendChannel) {}
        fn close_intake(&self) {}
        fn set_log(&self, _log: LogRegion) {}
    }

    /// A relay between two socket pairs: (front-end's end, back-end's end).
    fn relayed() -> (UnixStream, UnixStream, Vec<JoinHandle<()>>) {
        let (front, relay_front) = UnixStream::pair().unwrap();
        let (relay_back, back) = UnixStream::pair().unwrap();
        for s in [&front, &back] {
            s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        }
        let hints = SetupHints::new(
            vec![Arc::default()],
            vm_memory::GuestMemoryAtomic::new(crate::virtio::GuestMem::new()),
        );
        let threads = relay(relay_front, relay_back, Arc::new(NoDevice), hints).unwrap();
        (front, back, threads)
    }

    fn vring_num(num: u32) -> Vec<u8> {
        let flags = wire::VERSION | wire::NEED_REPLY;
        let mut m = Header::new(SET_VRING_NUM, flags, 8).to_bytes().to_vec();
        m.extend_from_slice(&0u32.to_le_bytes());
        m.extend_from_slice(&num.to_le_bytes());
        m
    }

    #[test]
    fn set_vring_num_must_be_a_power_of_two() {
        let (mut front, mut back, threads) = relayed();
        // A valid size passes through untouched.
        front.write_all(&vring_num(128)).unwrap();
        let mut got = [0u8; 20];
        back.read_exact(&mut got).unwrap();
        assert_eq!(got.to_vec(), vring_num(128));
        // Another is refused here, not forwarded, and the connection ends.
        front.write_all(&vring_num(100)).unwrap();
        let mut reply = [0u8; 20];
        front.read_exact(&mut reply).unwrap();
        let hdr = Header::from_bytes(reply[..HEADER_LEN].try_into().unwrap());
        assert_eq!(hdr.request, SET_VRING_NUM);
        assert!(hdr.is_reply());
        assert_eq!(u64::from_le_bytes(reply[12..20].try_into().unwrap()), 1);
        let mut rest = Vec::new();
        assert_eq!(
            back.read_to_end(&mut rest).unwrap(),
            0,
            "forwarded: {rest:?}"
        );
        assert_eq!(front.read_to_end(&mut rest).unwrap(), 0);
        for t in threads {
            t.join().unwrap();
        }
    }

    /// Sends `code` for ring 0 with `fds` and waits until the back-end's end
    /// has it (so the relay has followed it).
    fn vring_fd_msg(front: &UnixStream, back: &UnixStream, code: FrontendReq, fds: &[RawFd]) {
        let value = if fds.is_empty() { VRING_NOFD } else { 0 };
        let m = Msg {
            request: code.into(),
            flags: wire::VERSION,
            payload: VhostUserU64::new(value).as_slice().to_vec(),
            fds: vec![],
        };
        let hdr = m.header().to_bytes();
        send_all(front, &hdr, &m.payload, fds).unwrap();
        let got = read_msg(back, TRUSTED).unwrap().expect("forwarded");
        assert_eq!(got.request, u32::from(code));
        assert_eq!(got.fds.len(), fds.len(), "fds passed on");
    }

    fn signalled(call: &vmm_sys_util::eventfd::EventFd) -> bool {
        // The relay writes before it reads the next message, which the
        // tests send only after seeing the previous one forwarded; a short
        // grace covers the write racing that read.
        std::thread::sleep(Duration::from_millis(20));
        call.read().is_ok()
    }

    #[test]
    fn a_started_ring_with_a_call_fd_is_signalled_once() {
        use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};
        let (front, back, threads) = relayed();
        let kick = EventFd::new(EFD_NONBLOCK).unwrap();
        let (c1, c2) = (
            EventFd::new(EFD_NONBLOCK).unwrap(),
            EventFd::new(EFD_NONBLOCK).unwrap(),
        );
        // QEMU's order: the call fd first; the signal comes with the kick.
        vring_fd_msg(
            &front,
            &back,
            FrontendReq::SET_VRING_CALL,
            &[c1.as_raw_fd()],
        );
        assert!(!signalled(&c1), "signalled before the ring started");
        vring_fd_msg(
            &front,
            &back,
            FrontendReq::SET_VRING_KICK,
            &[kick.as_raw_fd()],
        );
        assert!(signalled(&c1), "not signalled when the ring started");
        assert!(!signalled(&c1), "signalled more than once");
        // A new call fd on the started ring is signalled at once.
        vring_fd_msg(
            &front,
            &back,
            FrontendReq::SET_VRING_CALL,
            &[c2.as_raw_fd()],
        );
        assert!(signalled(&c2), "new call fd on a started ring");
        assert!(!signalled(&c1), "the old call fd");
        // Stopped (GET_VRING_BASE): a new call fd waits for the next start.
        let stop = VhostUserVringState::new(0, 0);
        let hdr = Header::new(FrontendReq::GET_VRING_BASE, wire::VERSION, 8).to_bytes();
        send_all(&front, &hdr, stop.as_slice(), &[]).unwrap();
        read_msg(&back, TRUSTED)
            .unwrap()
            .expect("GET_VRING_BASE forwarded");
        vring_fd_msg(
            &front,
            &back,
            FrontendReq::SET_VRING_CALL,
            &[c1.as_raw_fd()],
        );
        assert!(!signalled(&c1), "signalled on a stopped ring");
        // No call fd (polling): nothing to signal, and no error.
        vring_fd_msg(&front, &back, FrontendReq::SET_VRING_CALL, &[]);
        vring_fd_msg(
            &front,
            &back,
            FrontendReq::SET_VRING_KICK,
            &[kick.as_raw_fd()],
        );
        assert!(!signalled(&c1), "a call fd the front-end withdrew");
        drop(front);
        drop(back);
        for t in threads {
            t.join().unwrap();
        }
    }
}
