//! A raw vhost-user front-end for the hostile-front-end tests: it writes
//! messages byte by byte (so it can also write wrong ones), shares guest
//! memory it maps itself, and drives split virtqueues on it as a guest
//! driver would, descriptor by descriptor.
//!
//! Nothing here trusts the daemon: every read from the socket has a
//! timeout, every wait for a used element has a deadline, and a daemon that
//! closes the connection is an answer (`Outcome::Closed`), not an error.

use std::fs::File;
use std::io::{self, Read};
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::{Ordering, fence};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

// Descriptors are written by the library's writer (feature `test-utils`),
// which writes wrong chains as readily as right ones.
use ringblk::virtio::chain_writer::{Desc, DescTable, link};
use vm_memory::{
    Bytes, FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestRegionMmap,
    MmapRegion,
};
use vmm_sys_util::eventfd::EventFd;
use vmm_sys_util::sock_ctrl_msg::ScmSocket;

use crate::{Daemon, MIB};

/// How long the daemon may take to answer one message or one request.
pub const ANSWER_TIMEOUT: Duration = Duration::from_secs(10);

// ---------------------------------------------------------------------------
// The protocol (vhost-user spec, "Front-end message types")

pub const GET_FEATURES: u32 = 1;
pub const SET_FEATURES: u32 = 2;
pub const SET_OWNER: u32 = 3;
pub const RESET_OWNER: u32 = 4;
pub const SET_MEM_TABLE: u32 = 5;
pub const SET_LOG_BASE: u32 = 6;
pub const SET_VRING_NUM: u32 = 8;
pub const SET_VRING_ADDR: u32 = 9;
pub const SET_VRING_BASE: u32 = 10;
pub const GET_VRING_BASE: u32 = 11;
pub const SET_VRING_KICK: u32 = 12;
pub const SET_VRING_CALL: u32 = 13;
pub const SET_VRING_ERR: u32 = 14;
pub const GET_PROTOCOL_FEATURES: u32 = 15;
pub const SET_PROTOCOL_FEATURES: u32 = 16;
pub const GET_QUEUE_NUM: u32 = 17;
pub const SET_VRING_ENABLE: u32 = 18;
pub const GET_CONFIG: u32 = 24;
pub const SET_CONFIG: u32 = 25;
pub const GET_INFLIGHT_FD: u32 = 31;
pub const SET_INFLIGHT_FD: u32 = 32;
pub const GET_MAX_MEM_SLOTS: u32 = 36;
pub const ADD_MEM_REG: u32 = 37;
pub const REM_MEM_REG: u32 = 38;

use ringblk::vhost::relay::wire::{HEADER_LEN, Header};
/// Header flags: the daemon's own definitions (one place for the header).
pub use ringblk::vhost::relay::wire::{
    NEED_REPLY as FLAG_NEED_REPLY, REPLY as FLAG_REPLY, VERSION as FLAG_VERSION,
};

/// Virtio feature bits.
pub const F_INDIRECT_DESC: u64 = 1 << 28;
pub const F_EVENT_IDX: u64 = 1 << 29;
pub const F_PROTOCOL_FEATURES: u64 = 1 << 30;
/// VHOST_F_LOG_ALL: dirty-page logging on (a migration).
pub const F_LOG_ALL: u64 = 1 << 26;
pub const F_VERSION_1: u64 = 1 << 32;

/// Protocol feature bits.
pub const P_MQ: u64 = 1 << 0;
pub const P_LOG_SHMFD: u64 = 1 << 1;
pub const P_REPLY_ACK: u64 = 1 << 3;
pub const P_CONFIG: u64 = 1 << 9;
pub const P_INFLIGHT_SHMFD: u64 = 1 << 12;
pub const P_CONFIGURE_MEM_SLOTS: u64 = 1 << 15;
/// What `handshake` acks.
pub const PROTOCOL: u64 = P_MQ | P_REPLY_ACK | P_CONFIG | P_INFLIGHT_SHMFD | P_CONFIGURE_MEM_SLOTS;

/// `SET_VRING_KICK`/`CALL` payload bit: no fd follows.
pub const VRING_NOFD: u64 = 0x100;

/// A message header announcing `size` payload bytes (which a hostile
/// test may then not send).
pub fn header(request: u32, flags: u32, size: u32) -> [u8; HEADER_LEN] {
    Header {
        request,
        flags,
        size,
    }
    .to_bytes()
}

/// Payload of SET_VRING_NUM/BASE/ENABLE and GET_VRING_BASE.
pub fn vring_state(index: u32, num: u32) -> Vec<u8> {
    [index.to_le_bytes(), num.to_le_bytes()].concat()
}

/// Payload of SET_VRING_ADDR (addresses are the front-end's virtual ones).
pub fn vring_addr(index: u32, desc: u64, used: u64, avail: u64) -> Vec<u8> {
    let mut p = Vec::with_capacity(40);
    p.extend_from_slice(&index.to_le_bytes());
    p.extend_from_slice(&0u32.to_le_bytes()); // flags
    for a in [desc, used, avail, 0] {
        p.extend_from_slice(&a.to_le_bytes());
    }
    p
}

/// One `VhostUserMemoryRegion`.
#[derive(Clone, Copy, Debug)]
pub struct Region {
    pub gpa: u64,
    pub size: u64,
    pub user_addr: u64,
    pub mmap_offset: u64,
}

impl Region {
    fn bytes(&self) -> [u8; 32] {
        let mut b = [0u8; 32];
        for (i, v) in [self.gpa, self.size, self.user_addr, self.mmap_offset]
            .iter()
            .enumerate()
        {
            b[i * 8..i * 8 + 8].copy_from_slice(&v.to_le_bytes());
        }
        b
    }
}

pub fn region(gpa: u64, size: u64, user_addr: u64, mmap_offset: u64) -> Region {
    Region {
        gpa,
        size,
        user_addr,
        mmap_offset,
    }
}

/// Payload of SET_MEM_TABLE: `num_regions` (which may lie) and the regions.
pub fn mem_table(num_regions: u32, regions: &[Region]) -> Vec<u8> {
    let mut p = Vec::with_capacity(8 + 32 * regions.len());
    p.extend_from_slice(&num_regions.to_le_bytes());
    p.extend_from_slice(&0u32.to_le_bytes());
    for r in regions {
        p.extend_from_slice(&r.bytes());
    }
    p
}

/// Payload of ADD_MEM_REG: 8 bytes of padding, then the region.
pub fn single_region(r: &Region) -> Vec<u8> {
    [&[0u8; 8][..], &r.bytes()[..]].concat()
}

/// Payload of GET/SET_CONFIG: offset, size, flags, then `data`.
pub fn config(offset: u32, size: u32, data: &[u8]) -> Vec<u8> {
    let mut p = Vec::with_capacity(12 + data.len());
    p.extend_from_slice(&offset.to_le_bytes());
    p.extend_from_slice(&size.to_le_bytes());
    p.extend_from_slice(&0u32.to_le_bytes());
    p.extend_from_slice(data);
    p
}

/// Payload of GET/SET_INFLIGHT_FD (`struct VhostUserInflight`, 24 bytes).
pub fn inflight(mmap_size: u64, mmap_offset: u64, num_queues: u16, queue_size: u16) -> Vec<u8> {
    let mut p = vec![0u8; 24];
    p[0..8].copy_from_slice(&mmap_size.to_le_bytes());
    p[8..16].copy_from_slice(&mmap_offset.to_le_bytes());
    p[16..18].copy_from_slice(&num_queues.to_le_bytes());
    p[18..20].copy_from_slice(&queue_size.to_le_bytes());
    p
}

pub fn u64_payload(v: u64) -> Vec<u8> {
    v.to_le_bytes().to_vec()
}

// ---------------------------------------------------------------------------
// The connection

/// A message from the daemon.
#[derive(Debug)]
pub struct Msg {
    pub request: u32,
    pub flags: u32,
    pub payload: Vec<u8>,
    pub fd: Option<File>,
}

impl Msg {
    /// The payload's first 8 bytes as a u64 (REPLY_ACK, GET_FEATURES, ...).
    pub fn u64(&self) -> Option<u64> {
        Some(u64::from_le_bytes(self.payload.get(..8)?.try_into().ok()?))
    }
}

/// How the daemon answered a message.
#[derive(Debug)]
pub enum Outcome {
    /// A reply (for REPLY_ACK: an 8-byte status, 0 for success).
    Reply(Msg),
    /// The daemon closed the connection.
    Closed,
}

impl Outcome {
    /// A one-line description for the catalogue's report.
    pub fn describe(&self) -> String {
        match self {
            Outcome::Reply(m) if m.payload.len() == 8 => {
                format!("reply {:#x}", m.u64().unwrap_or(0))
            }
            Outcome::Reply(m) => format!(
                "reply of {} bytes{}",
                m.payload.len(),
                if m.fd.is_some() { " with an fd" } else { "" }
            ),
            Outcome::Closed => "disconnect".into(),
        }
    }

    /// An error reply (REPLY_ACK status != 0) or a disconnect.
    pub fn is_refusal(&self) -> bool {
        match self {
            Outcome::Reply(m) => m.payload.len() == 8 && m.u64() != Some(0),
            Outcome::Closed => true,
        }
    }
}

/// One vhost-user connection to the daemon.
pub struct Conn {
    pub sock: UnixStream,
}

fn is_disconnect(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionReset | io::ErrorKind::BrokenPipe | io::ErrorKind::UnexpectedEof
    )
}

impl Conn {
    /// Connects; the daemon serves one front-end at a time, so this may
    /// wait in the listen backlog until the previous one is torn down.
    pub fn connect(path: &Path) -> Conn {
        let sock = UnixStream::connect(path)
            .unwrap_or_else(|e| panic!("connecting to {}: {e}", path.display()));
        sock.set_read_timeout(Some(ANSWER_TIMEOUT))
            .expect("SO_RCVTIMEO");
        sock.set_write_timeout(Some(ANSWER_TIMEOUT))
            .expect("SO_SNDTIMEO");
        Conn { sock }
    }

    /// Sends `bytes` as they are, with `fds` attached to the first byte.
    /// A daemon that already hung up is not an error here: the answer
    /// (`recv`) tells.
    pub fn send_raw(&self, bytes: &[u8], fds: &[RawFd]) -> io::Result<()> {
        let mut sent = match self.sock.send_with_fds(&[bytes], fds) {
            Ok(n) => n,
            Err(e) => return Err(io::Error::from(e)),
        };
        while sent < bytes.len() {
            match self.sock.send_with_fds(&[&bytes[sent..]], &[]) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => sent += n,
                Err(e) => return Err(io::Error::from(e)),
            }
        }
        Ok(())
    }

    /// Sends a well-framed message: the header's size is the payload's.
    pub fn send(&self, request: u32, flags: u32, payload: &[u8], fds: &[RawFd]) -> io::Result<()> {
        let mut buf = header(request, flags, payload.len() as u32).to_vec();
        buf.extend_from_slice(payload);
        self.send_raw(&buf, fds)
    }

    /// Reads one message; `None` when the daemon closed the connection.
    /// Panics if nothing comes within `ANSWER_TIMEOUT`.
    pub fn recv(&self) -> Option<Msg> {
        let mut hdr = [0u8; HEADER_LEN];
        let (n, fd) = match self.sock.recv_with_fd(&mut hdr) {
            Ok(r) => r,
            Err(e) => {
                let e = io::Error::from(e);
                if is_disconnect(&e) {
                    return None;
                }
                panic!("no answer from the daemon within {ANSWER_TIMEOUT:?}: {e}");
            }
        };
        if n == 0 {
            return None;
        }
        let rest = |buf: &mut [u8]| match (&self.sock).read_exact(buf) {
            Ok(()) => true,
            Err(e) if is_disconnect(&e) => false,
            Err(e) => panic!("reading a message from the daemon: {e}"),
        };
        if !rest(&mut hdr[n..]) {
            return None;
        }
        let Header {
            request,
            flags,
            size,
        } = Header::from_bytes(&hdr);
        assert!(
            size <= 64 * 1024,
            "the daemon announced a reply of {size} bytes"
        );
        let mut payload = vec![0u8; size as usize];
        if !rest(&mut payload) {
            return None;
        }
        Some(Msg {
            request,
            flags,
            payload,
            fd,
        })
    }

    /// Sends `request` with NEED_REPLY and returns the answer.
    pub fn ask(&self, request: u32, payload: &[u8], fds: &[RawFd]) -> Outcome {
        self.ask_flags(request, FLAG_VERSION | FLAG_NEED_REPLY, payload, fds)
    }

    /// Sends with the given flags; expects a reply or a disconnect.
    pub fn ask_flags(&self, request: u32, flags: u32, payload: &[u8], fds: &[RawFd]) -> Outcome {
        // If the daemon hung up while we were still sending, its answer
        // is the disconnect recv() sees.
        let _ = self.send(request, flags, payload, fds);
        self.answer(request)
    }

    /// Reads the answer to `request`.
    pub fn answer(&self, request: u32) -> Outcome {
        match self.recv() {
            None => Outcome::Closed,
            Some(m) => {
                assert_eq!(
                    m.request, request,
                    "reply to request {} while waiting for {request}",
                    m.request
                );
                assert_ne!(m.flags & FLAG_REPLY, 0, "a reply without the REPLY flag");
                Outcome::Reply(m)
            }
        }
    }

    /// A message that must succeed: REPLY_ACK status 0.
    #[track_caller]
    pub fn ok(&self, request: u32, payload: &[u8], fds: &[RawFd]) {
        match self.ask(request, payload, fds) {
            Outcome::Reply(m) if m.u64() == Some(0) && m.payload.len() == 8 => {}
            other => panic!("request {request} failed: {}", other.describe()),
        }
    }

    /// A GET_* message (no NEED_REPLY: it always has a reply).
    #[track_caller]
    pub fn get(&self, request: u32, payload: &[u8]) -> Msg {
        match self.ask_flags(request, FLAG_VERSION, payload, &[]) {
            Outcome::Reply(m) => m,
            Outcome::Closed => panic!("the daemon hung up on request {request}"),
        }
    }

    /// SET_OWNER, features (VERSION_1 | PROTOCOL_FEATURES | `extra`) and
    /// protocol features (`PROTOCOL`, so REPLY_ACK works from here on).
    /// Returns the device's features.
    pub fn handshake(&self, extra: u64) -> u64 {
        self.handshake_with(extra, 0)
    }

    /// `handshake`, with `extra_protocol` protocol features acked too.
    pub fn handshake_with(&self, extra: u64, extra_protocol: u64) -> u64 {
        self.send(SET_OWNER, FLAG_VERSION, &[], &[])
            .expect("SET_OWNER");
        let offered = self.get(GET_FEATURES, &[]).u64().expect("GET_FEATURES");
        let want = F_VERSION_1 | F_PROTOCOL_FEATURES | extra;
        assert_eq!(offered & want, want, "features {offered:#x} lack {want:#x}");
        self.send(SET_FEATURES, FLAG_VERSION, &u64_payload(want), &[])
            .expect("SET_FEATURES");
        let proto = self
            .get(GET_PROTOCOL_FEATURES, &[])
            .u64()
            .expect("GET_PROTOCOL_FEATURES");
        let want = PROTOCOL | extra_protocol;
        assert_eq!(proto & want, want, "protocol features {proto:#x}");
        self.send(SET_PROTOCOL_FEATURES, FLAG_VERSION, &u64_payload(want), &[])
            .expect("SET_PROTOCOL_FEATURES");
        // A round trip, so a refused feature shows up here and not later.
        assert_eq!(
            self.get(GET_QUEUE_NUM, &[]).request,
            GET_QUEUE_NUM,
            "GET_QUEUE_NUM"
        );
        offered
    }

    /// The config space bytes `offset..offset + size` (GET_CONFIG).
    pub fn config(&self, offset: u32, size: u32) -> Vec<u8> {
        let m = self.get(GET_CONFIG, &config(offset, size, &vec![0u8; size as usize]));
        assert_eq!(m.payload.len(), 12 + size as usize, "GET_CONFIG reply");
        m.payload[12..].to_vec()
    }

    /// Half-closes: the daemon reads end of stream after what was sent.
    pub fn shutdown_write(&self) {
        let _ = self.sock.shutdown(std::net::Shutdown::Write);
    }
}

// ---------------------------------------------------------------------------
// Shared memory

/// A memfd of `size` bytes (not sealed).
pub fn memfd(size: u64) -> File {
    // SAFETY: the name is a NUL-terminated literal and the flags are valid;
    // memfd_create takes no other pointer.
    let fd = unsafe {
        libc::memfd_create(
            c"hostile-frontend".as_ptr(),
            libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
        )
    };
    assert!(fd >= 0, "memfd_create: {}", io::Error::last_os_error());
    // SAFETY: `fd` is a fresh descriptor nobody else owns.
    let f = unsafe { File::from_raw_fd(fd) };
    f.set_len(size).expect("sizing the memfd");
    f
}

/// Seals `f` against shrinking and growing (what the daemon's inflight
/// handling requires of a region it maps).
pub fn seal(f: &File) {
    let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
    // SAFETY: fcntl on a descriptor we own, with an int argument.
    let r = unsafe { libc::fcntl(f.as_raw_fd(), libc::F_ADD_SEALS, seals) };
    assert_eq!(r, 0, "F_ADD_SEALS: {}", io::Error::last_os_error());
}

/// Guest memory: one memfd, shared with the daemon as two regions with a
/// hole between them.
///
/// ```text
/// GPA 0x000_0000 .. 0x080_0000   region 0 (file offset 0)
/// GPA 0x080_0000 .. 0x0c0_0000   hole
/// GPA 0x0c0_0000 .. 0x140_0000   region 1 (file offset 8 MiB)
/// ```
pub struct Guest {
    pub mem: GuestMemoryMmap,
    pub file: File,
    pub regions: Vec<Region>,
}

pub const REGION0_END: u64 = 8 * MIB;
pub const REGION1: u64 = 12 * MIB;
pub const REGION1_END: u64 = 20 * MIB;

impl Default for Guest {
    fn default() -> Guest {
        Guest::new()
    }
}

impl Guest {
    /// The standard layout above.
    pub fn new() -> Guest {
        Guest::map(
            memfd(16 * MIB),
            &[
                (0, REGION0_END, 0),
                (REGION1, REGION1_END - REGION1, 8 * MIB),
            ],
        )
    }

    /// Maps `file` at (guest address, size, file offset) for each region.
    pub fn map(file: File, layout: &[(u64, u64, u64)]) -> Guest {
        let mapped = layout
            .iter()
            .map(|&(gpa, size, off)| {
                let f = file.try_clone().expect("dup of the memfd");
                let region = MmapRegion::from_file(FileOffset::new(f, off), size as usize)
                    .expect("mapping guest memory");
                GuestRegionMmap::new(region, GuestAddress(gpa)).expect("guest region")
            })
            .collect();
        let mem = GuestMemoryMmap::from_regions(mapped).expect("guest memory");
        let regions = layout
            .iter()
            .map(|&(gpa, size, off)| Region {
                gpa,
                size,
                user_addr: mem
                    .get_host_address(GuestAddress(gpa))
                    .expect("host address") as u64,
                mmap_offset: off,
            })
            .collect();
        Guest { mem, file, regions }
    }

    /// The front-end's virtual address of `gpa` (for SET_VRING_ADDR).
    pub fn va(&self, gpa: u64) -> u64 {
        self.mem
            .get_host_address(GuestAddress(gpa))
            .unwrap_or_else(|e| panic!("{gpa:#x} is not guest memory: {e}")) as u64
    }

    pub fn write(&self, gpa: u64, bytes: &[u8]) {
        self.mem
            .write_slice(bytes, GuestAddress(gpa))
            .unwrap_or_else(|e| panic!("writing guest memory at {gpa:#x}: {e}"));
    }

    pub fn read(&self, gpa: u64, len: usize) -> Vec<u8> {
        let mut b = vec![0u8; len];
        self.mem
            .read_slice(&mut b, GuestAddress(gpa))
            .unwrap_or_else(|e| panic!("reading guest memory at {gpa:#x}: {e}"));
        b
    }

    pub fn byte(&self, gpa: u64) -> u8 {
        self.read(gpa, 1)[0]
    }

    /// Writes descriptors exactly as given at indices `first..` of the
    /// table at `table` (a queue's or an indirect one).
    pub fn write_descs(&self, table: u64, first: u16, descs: &[Desc]) {
        DescTable::at(table)
            .write(&self.mem, first, descs)
            .unwrap_or_else(|e| panic!("writing descriptors at {table:#x} [{first}..]: {e}"));
    }

    /// SET_MEM_TABLE with both regions (one fd each).
    pub fn share(&self, conn: &Conn) {
        let fds = [self.file.as_raw_fd(); 2];
        conn.ok(SET_MEM_TABLE, &mem_table(2, &self.regions), &fds);
    }
}

// ---------------------------------------------------------------------------
// Split virtqueues

/// The driver side of one split virtqueue in `Guest` memory, with its
/// kick and call eventfds.
pub struct Vq {
    pub index: u32,
    pub size: u16,
    pub desc: u64,
    pub avail: u64,
    pub used: u64,
    pub kick: EventFd,
    pub call: EventFd,
    /// VIRTIO_RING_F_EVENT_IDX negotiated: the driver asks for each
    /// interrupt through `used_event`.
    pub event_idx: bool,
    next_avail: u16,
    last_used: u16,
}

impl Vq {
    /// Rings at `base` (descriptors), `base + 0x1000` (avail) and
    /// `base + 0x2000` (used): room for queues of up to 256 entries.
    pub fn new(index: u32, size: u16, base: u64) -> Vq {
        Vq {
            index,
            size,
            desc: base,
            avail: base + 0x1000,
            used: base + 0x2000,
            kick: EventFd::new(libc::EFD_NONBLOCK | libc::EFD_CLOEXEC).expect("kick eventfd"),
            call: EventFd::new(libc::EFD_NONBLOCK | libc::EFD_CLOEXEC).expect("call eventfd"),
            event_idx: false,
            next_avail: 0,
            last_used: 0,
        }
    }

    /// Sets the ring up on the daemon: NUM, ADDR, BASE, CALL, KICK, ENABLE.
    pub fn setup(&self, conn: &Conn, g: &Guest) {
        // Zeroed rings: flags 0 (interrupts wanted), both indexes 0.
        g.write(self.desc, &vec![0u8; 16 * usize::from(self.size)]);
        g.write(self.avail, &vec![0u8; 6 + 2 * usize::from(self.size)]);
        g.write(self.used, &vec![0u8; 6 + 8 * usize::from(self.size)]);
        self.attach(conn, g, 0, true);
    }

    /// Hands the rings as they are in memory to a (new) daemon, resuming
    /// the avail ring at `base`: NUM, ADDR, BASE, then CALL and KICK in
    /// QEMU's order (`call_first`) or the other, then ENABLE. Writes no kick.
    pub fn attach(&self, conn: &Conn, g: &Guest, base: u16, call_first: bool) {
        conn.ok(
            SET_VRING_NUM,
            &vring_state(self.index, self.size.into()),
            &[],
        );
        let addr = vring_addr(
            self.index,
            g.va(self.desc),
            g.va(self.used),
            g.va(self.avail),
        );
        conn.ok(SET_VRING_ADDR, &addr, &[]);
        conn.ok(SET_VRING_BASE, &vring_state(self.index, base.into()), &[]);
        let idx = u64_payload(u64::from(self.index));
        let call = || conn.ok(SET_VRING_CALL, &idx, &[self.call.as_raw_fd()]);
        let kick = || conn.ok(SET_VRING_KICK, &idx, &[self.kick.as_raw_fd()]);
        if call_first {
            call();
            kick();
        } else {
            kick();
            call();
        }
        conn.ok(SET_VRING_ENABLE, &vring_state(self.index, 1), &[]);
    }

    /// Writes table entries at indices `first..`, as given.
    pub fn write_table(&self, g: &Guest, first: u16, descs: &[Desc]) {
        let end = u64::from(first) + descs.len() as u64;
        assert!(
            end <= u64::from(self.size),
            "descriptors {first}..{end} run past a table of {}",
            self.size
        );
        g.write_descs(self.desc, first, descs);
    }

    /// Puts `heads` on the avail ring, moves avail->idx once, and kicks.
    pub fn publish(&mut self, g: &Guest, heads: &[u16]) {
        self.publish_without_kick(g, heads);
        self.kick.write(1).expect("kick");
    }

    /// Makes `heads` available as [`Vq::publish`] does, without kicking:
    /// what a driver does while the device has asked not to be kicked.
    pub fn publish_without_kick(&mut self, g: &Guest, heads: &[u16]) {
        for &h in heads {
            let slot = u64::from(self.next_avail % self.size);
            g.write(self.avail + 4 + 2 * slot, &h.to_le_bytes());
            self.next_avail = self.next_avail.wrapping_add(1);
        }
        self.set_avail_idx(g, self.next_avail);
    }

    /// Stores avail->idx (release: the entries and descriptors first).
    /// With EVENT_IDX, first asks for an interrupt at the next used
    /// element (`used_event` = the used index seen so far).
    pub fn set_avail_idx(&self, g: &Guest, idx: u16) {
        if self.event_idx {
            let used_event = self.avail + 4 + 2 * u64::from(self.size);
            g.write(used_event, &self.last_used.to_le_bytes());
        }
        fence(Ordering::SeqCst);
        g.mem
            .store(idx, GuestAddress(self.avail + 2), Ordering::Release)
            .expect("avail->idx");
    }

    /// Writes `descs` linked from table index 0 and publishes the chain.
    /// Returns its head (0).
    pub fn post(&mut self, g: &Guest, descs: &[Desc]) -> u16 {
        self.write_table(g, 0, &link(descs, 0));
        self.publish(g, &[0]);
        0
    }

    pub fn used_idx(&self, g: &Guest) -> u16 {
        g.mem
            .load(GuestAddress(self.used + 2), Ordering::Acquire)
            .expect("used->idx")
    }

    /// Used elements published since the last call, waiting up to
    /// `timeout` for at least `n` of them (fewer come back on timeout).
    pub fn take_used(&mut self, g: &Guest, n: u16, timeout: Duration) -> Vec<(u32, u32)> {
        let deadline = Instant::now() + timeout;
        loop {
            let ready = self.used_idx(g).wrapping_sub(self.last_used);
            assert!(
                ready <= self.size,
                "used->idx moved {ready} past the {} we have seen on a queue of {}",
                self.last_used,
                self.size
            );
            let now = Instant::now();
            if ready >= n || now >= deadline {
                let mut out = Vec::new();
                for _ in 0..ready {
                    let slot = u64::from(self.last_used % self.size);
                    let e = g.read(self.used + 4 + 8 * slot, 8);
                    out.push((
                        u32::from_le_bytes(e[0..4].try_into().unwrap()),
                        u32::from_le_bytes(e[4..8].try_into().unwrap()),
                    ));
                    self.last_used = self.last_used.wrapping_add(1);
                }
                return out;
            }
            wait_readable(&self.call, (deadline - now).min(Duration::from_millis(50)));
            let _ = self.call.read();
        }
    }

    /// Exactly one used element within `ANSWER_TIMEOUT`.
    #[track_caller]
    pub fn one_used(&mut self, g: &Guest) -> (u32, u32) {
        let got = self.take_used(g, 1, ANSWER_TIMEOUT);
        assert_eq!(
            got.len(),
            1,
            "queue {}: expected one used element within {ANSWER_TIMEOUT:?}, got {got:?}",
            self.index
        );
        got[0]
    }
}

/// poll(2) on an eventfd for at most `timeout`.
fn wait_readable(fd: &EventFd, timeout: Duration) {
    let mut p = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    let ms = timeout.as_millis().clamp(1, 1000) as libc::c_int;
    // SAFETY: one valid pollfd for the duration of the call.
    unsafe { libc::poll(&mut p, 1, ms) };
}

// ---------------------------------------------------------------------------
// Proof that the daemon still serves

/// blkio's view of the proof: connect, write a pattern, read it back.
fn blkio_roundtrip(socket: &Path, offset: u64, pattern: &[u8]) -> Result<Vec<u8>, String> {
    use blkio::{Blkio, Completion, ReqFlags};
    use std::mem::MaybeUninit;
    let e = |what: &str, err: blkio::Error| format!("{what}: {err}");
    let mut b = Blkio::new("virtio-blk-vhost-user").map_err(|x| e("new", x))?;
    b.set_str("path", socket.to_str().ok_or("socket path")?)
        .map_err(|x| e("path", x))?;
    b.connect().map_err(|x| e("connect", x))?;
    let mut started = b.start().map_err(|x| e("start", x))?;
    let len = pattern.len();
    let region = b.alloc_mem_region(2 * len).map_err(|x| e("alloc", x))?;
    b.map_mem_region(&region).map_err(|x| e("map", x))?;
    // SAFETY: blkio mapped `region` read-write for `region.len` bytes and
    // keeps it mapped until `b` is dropped at the end of this function;
    // the device touches it only while a request below is in flight, and
    // each request is waited for before the slice is used again.
    let mem = unsafe { std::slice::from_raw_parts_mut(region.addr as *mut u8, region.len) };
    let (wbuf, rbuf) = mem.split_at_mut(len);
    wbuf.copy_from_slice(pattern);
    let q = &mut started.queues[0];
    let mut one = |q: &mut blkio::Blkioq, write: bool| -> Result<(), String> {
        if write {
            q.write(offset, wbuf.as_ptr(), len, 1, ReqFlags::empty());
        } else {
            q.read(offset, rbuf.as_mut_ptr(), len, 2, ReqFlags::empty());
        }
        let mut c = [MaybeUninit::<Completion>::uninit()];
        let mut timeout = ANSWER_TIMEOUT;
        let n = q
            .do_io(&mut c, 1, Some(&mut timeout), None)
            .map_err(|x| e("do_io", x))?;
        if n != 1 {
            return Err("no completion".into());
        }
        // SAFETY: do_io() initialized the first `n` (= 1) slots.
        let c = unsafe { c[0].assume_init_ref() };
        if c.ret != 0 {
            return Err(format!("request failed: {}", c.ret));
        }
        Ok(())
    };
    one(q, true)?;
    one(q, false)?;
    Ok(rbuf.to_vec())
}

/// The daemon is alive and a fresh blkio client can write 4 KiB at
/// `offset` and read the same bytes back (and they are in the image).
/// `offset` and `seed` should differ between calls so a stale answer
/// cannot pass.
#[track_caller]
pub fn assert_serves(d: &mut Daemon, what: &str, offset: u64, seed: u8) {
    d.assert_running();
    let pattern: Vec<u8> = (0..4096u32)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect();
    // blkio blocks on the socket without a timeout of its own; a thread
    // with a deadline turns a hung daemon into a failure (and the Daemon's
    // drop kills the daemon, which releases the thread).
    let (tx, rx) = mpsc::channel();
    let socket = d.socket.clone();
    let want = pattern.clone();
    thread::spawn(move || {
        let _ = tx.send(blkio_roundtrip(&socket, offset, &want));
    });
    let got = match rx.recv_timeout(2 * ANSWER_TIMEOUT) {
        Ok(Ok(got)) => got,
        Ok(Err(e)) => panic!("after {what}: a fresh blkio client failed: {e}"),
        Err(_) => panic!(
            "after {what}: a fresh blkio client got no answer within {:?}",
            2 * ANSWER_TIMEOUT
        ),
    };
    assert!(got == pattern, "after {what}: blkio read back other data");
    assert!(
        d.read_image(offset, pattern.len()) == pattern,
        "after {what}: the image does not hold what blkio wrote"
    );
    d.assert_running();
}

/// Open file descriptors of process `pid`.
pub fn fd_count(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0)
}
