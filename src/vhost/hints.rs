//! The two set-up mistakes an operator makes most often with QEMU, told
//! apart from the vhost-user messages the relay passes on ([`super::relay`])
//! and logged once, each with what to change (docs/troubleshooting.md).
//!
//! - **Guest memory not shared** (`share=on` missing on QEMU's memory
//!   backend, or no memory backend at all). vhost-user maps guest memory
//!   through file descriptors, so QEMU filters out RAM that has none and,
//!   where it has one (a memfd), still maps it privately without
//!   `share=on`. Two symptoms:
//!   - no memory region at all before the first ring is set up: the crate
//!     then fails SET_VRING_ADDR ("invalid parameters") and the
//!     connection ends;
//!   - a region with an fd the guest never writes through (a private
//!     mapping, QEMU 7.2's `share=off` memfd): every ring starts, but the
//!     guest's requests never appear. Its kicks arrive and its avail ring,
//!     read through our mapping, stays where SET_VRING_BASE put it, and
//!     guest memory as we map it is blank (a running guest's holds its
//!     firmware and kernel). QEMU also kicks a ring itself as it starts
//!     it, so kicks alone do not tell a guest that has not used the disk
//!     yet from one we cannot see.
//! - **Queue counts that differ.** QEMU's `vhost-user-blk-pci` asks for
//!   `num-queues` queues (by default one per vCPU). Given fewer by
//!   GET_QUEUE_NUM it hangs up at once, and tries three more times; a
//!   front-end that does not ask sets up rings past ours, or sizes its
//!   inflight region for more.
//!
//! Each hint is rate-limited: a front-end can repeat the mistake at will.

use std::sync::Arc;
use std::time::{Duration, Instant};

use vhost::vhost_user::message::{
    FrontendReq, VhostUserInflight, VhostUserMemory, VhostUserMemoryRegion,
    VhostUserSingleMemoryRegion, VhostUserU64, VhostUserVringAddr, VhostUserVringState,
};
use vm_memory::{Bytes, GuestAddress, GuestAddressSpace, GuestMemoryAtomic};

use super::relay::wire::payload_as;
use crate::metrics::{QueueMetrics, SharedRateLimiter};
use crate::virtio::GuestMem;
use crate::warn_limited;

/// What to change for memory that is not shared, as the line ends.
pub const SHARE_ON: &str = "QEMU's memory backend needs share=on (e.g. -object memory-backend-memfd,id=mem,size=1G,share=on -numa node,memdev=mem)";

/// How often a started ring with kicks is looked at, how long a kicked
/// ring may stay still before it is suspect, and for how long after its
/// start it is looked at.
const CHECK_EVERY: Duration = Duration::from_millis(500);
const SETTLE: Duration = Duration::from_secs(2);
const CHECK_FOR: Duration = Duration::from_secs(30);
/// How much of the lowest guest memory is read to tell a guest's memory
/// from a blank one.
const BLANK_SCAN: u64 = 16 << 20;

static MEMORY: SharedRateLimiter = SharedRateLimiter::new(1, Duration::from_secs(30));
static QUEUES: SharedRateLimiter = SharedRateLimiter::new(1, Duration::from_secs(30));

/// A region of the front-end's memory table: its addresses in the
/// front-end's process and in the guest.
#[derive(Clone, Copy)]
struct Region {
    user_addr: u64,
    guest_addr: u64,
    size: u64,
}

impl From<&VhostUserMemoryRegion> for Region {
    fn from(r: &VhostUserMemoryRegion) -> Region {
        Region {
            user_addr: r.user_addr,
            guest_addr: r.guest_phys_addr,
            size: r.memory_size,
        }
    }
}

/// One of our rings, as the front-end set it up.
#[derive(Default)]
struct Ring {
    /// The avail ring's address in the front-end's process.
    avail: Option<u64>,
    /// SET_VRING_BASE: where the avail index starts.
    base: u16,
    /// Since SET_VRING_KICK: when, and the queue's kicks and finished
    /// requests then. `None` once looked at enough.
    started: Option<(Instant, u64, u64)>,
}

/// Follows one connection's messages; see the module's documentation.
pub struct SetupHints {
    queues: u16,
    metrics: Vec<Arc<QueueMetrics>>,
    mem: GuestMemoryAtomic<GuestMem>,
    regions: Vec<Region>,
    rings: Vec<Ring>,
    /// The last message relayed.
    last: Option<FrontendReq>,
}

impl SetupHints {
    /// For a device of `metrics.len()` queues whose memory, as the crate
    /// maps it, is `mem`.
    pub fn new(metrics: Vec<Arc<QueueMetrics>>, mem: GuestMemoryAtomic<GuestMem>) -> SetupHints {
        SetupHints {
            queues: u16::try_from(metrics.len()).unwrap_or(u16::MAX),
            rings: (0..metrics.len()).map(|_| Ring::default()).collect(),
            metrics,
            mem,
            regions: Vec::new(),
            last: None,
        }
    }

    /// Follows a message from the front-end, before it is relayed.
    pub fn follow(&mut self, code: FrontendReq, payload: &[u8]) {
        self.last = Some(code);
        let state = || payload_as::<VhostUserVringState>(payload);
        match code {
            FrontendReq::SET_MEM_TABLE => {
                let Some(m) = payload_as::<VhostUserMemory>(payload) else {
                    return;
                };
                let table = &payload[std::mem::size_of::<VhostUserMemory>()..];
                self.regions = table
                    .chunks_exact(std::mem::size_of::<VhostUserMemoryRegion>())
                    .take(m.num_regions as usize)
                    .filter_map(payload_as::<VhostUserMemoryRegion>)
                    .map(|r| Region::from(&r))
                    .collect();
            }
            FrontendReq::ADD_MEM_REG => {
                if let Some(r) = payload_as::<VhostUserSingleMemoryRegion>(payload) {
                    self.regions.push(Region::from(&*r));
                }
            }
            FrontendReq::REM_MEM_REG => {
                if let Some(r) = payload_as::<VhostUserSingleMemoryRegion>(payload) {
                    let gone = Region::from(&*r);
                    self.regions
                        .retain(|x| (x.guest_addr, x.size) != (gone.guest_addr, gone.size));
                }
            }
            FrontendReq::GET_INFLIGHT_FD | FrontendReq::SET_INFLIGHT_FD => {
                if let Some(a) = payload_as::<VhostUserInflight>(payload)
                    && a.num_queues > self.queues
                {
                    self.too_many_queues(a.num_queues);
                }
            }
            FrontendReq::SET_VRING_NUM
            | FrontendReq::SET_VRING_ENABLE
            | FrontendReq::GET_VRING_BASE => {
                if let Some(s) = state() {
                    self.ring(s.index);
                    if code == FrontendReq::GET_VRING_BASE {
                        self.stop(s.index);
                    }
                }
            }
            FrontendReq::SET_VRING_BASE => {
                if let Some(s) = state()
                    && let Some(ring) = self.ring(s.index)
                {
                    ring.base = s.num as u16;
                }
            }
            FrontendReq::SET_VRING_ADDR => {
                let Some(a) = payload_as::<VhostUserVringAddr>(payload) else {
                    return;
                };
                if self.regions.is_empty() {
                    warn_limited!(
                        MEMORY,
                        "the front-end set up a ring without sharing any guest memory with this daemon (no memory region with a file descriptor): {SHARE_ON}"
                    );
                }
                let available = a.available;
                if let Some(ring) = self.ring(a.index) {
                    ring.avail = Some(available);
                }
            }
            FrontendReq::SET_VRING_KICK
            | FrontendReq::SET_VRING_CALL
            | FrontendReq::SET_VRING_ERR => {
                let Some(v) = payload_as::<VhostUserU64>(payload) else {
                    return;
                };
                let index = (v.value & 0xff) as u32;
                if code == FrontendReq::SET_VRING_KICK {
                    let now = self.activity(index as usize);
                    if let (Some(ring), Some((kicks, done))) = (self.ring(index), now) {
                        ring.started = Some((Instant::now(), kicks, done));
                    }
                } else {
                    self.ring(index);
                }
            }
            FrontendReq::RESET_OWNER | FrontendReq::RESET_DEVICE => {
                (0..self.rings.len()).for_each(|i| self.stop(i as u32));
            }
            _ => {}
        }
    }

    /// The front-end closed the connection.
    pub fn hung_up(&mut self) {
        if self.last == Some(FrontendReq::GET_QUEUE_NUM) {
            warn_limited!(
                QUEUES,
                "the front-end hung up right after asking how many queues this daemon serves ({}): QEMU does that when its num-queues is larger (by default one per vCPU): pass --queues N with N its num-queues, or num-queues={} on its -device vhost-user-blk-pci",
                self.queues,
                self.queues
            );
        }
    }

    /// How long the relay may wait for the next message before it calls
    /// [`SetupHints::check`]; `None`: as long as it likes.
    pub fn wait(&self) -> Option<Duration> {
        self.rings
            .iter()
            .any(|r| r.started.is_some())
            .then_some(CHECK_EVERY)
    }

    /// Looks at the started rings: one that was kicked, never moved and
    /// finished nothing runs on memory this daemon does not share.
    pub fn check(&mut self) {
        for q in 0..self.rings.len() {
            let Some((since, kicks0, done0)) = self.rings[q].started else {
                continue;
            };
            if since.elapsed() > CHECK_FOR {
                self.rings[q].started = None;
                continue;
            }
            let Some((kicks, done)) = self.activity(q) else {
                continue;
            };
            let (base, idx) = (self.rings[q].base, self.avail_idx(q));
            log::debug!(
                "hints: queue {q} {:?} after its start: {} kick(s), {} finished, avail {idx:?} (base {base})",
                since.elapsed(),
                kicks - kicks0,
                done - done0,
            );
            if done != done0 || idx.is_some_and(|i| i != base) {
                // Requests showed up: the memory is shared.
                self.rings[q].started = None;
                continue;
            }
            if kicks == kicks0 || since.elapsed() < SETTLE || idx.is_none() {
                continue;
            }
            // Kicked, and still nothing after a while. QEMU kicks a ring
            // itself as it starts it (its host notifier begins set), so a
            // guest that has not used the disk yet looks the same; what
            // tells them apart is guest memory itself: a running guest's
            // low memory holds its firmware and kernel, a private mapping
            // shows us only zeroes.
            self.rings[q].started = None;
            if self.memory_blank() {
                warn_limited!(
                    MEMORY,
                    "queue {q} was kicked {} time(s), but its avail ring stays at {base} in the guest memory this daemon maps, which is blank: the front-end's guest memory is not shared with it: {SHARE_ON}",
                    kicks - kicks0
                );
            }
        }
    }

    /// Whether the lowest [`BLANK_SCAN`] bytes of guest memory, as this
    /// daemon maps them, are all zero.
    fn memory_blank(&self) -> bool {
        let Some(low) = self.regions.iter().min_by_key(|r| r.guest_addr) else {
            return false;
        };
        let mem = self.mem.memory();
        let mut buf = vec![0u8; 64 << 10];
        let mut at = 0;
        while at < low.size.min(BLANK_SCAN) {
            let n = (buf.len() as u64).min(low.size - at) as usize;
            if mem
                .read_slice(&mut buf[..n], GuestAddress(low.guest_addr + at))
                .is_err()
            {
                return false;
            }
            if buf[..n].iter().any(|&b| b != 0) {
                return false;
            }
            at += n as u64;
        }
        true
    }

    /// Ring `index` if the device has it; else a queue-count hint.
    fn ring(&mut self, index: u32) -> Option<&mut Ring> {
        if index >= u32::from(self.queues) {
            warn_limited!(
                QUEUES,
                "the front-end set up queue {index}, but this daemon serves {} queue(s): pass --queues {} or set num-queues={} on the front-end (QEMU's -device vhost-user-blk-pci)",
                self.queues,
                index + 1,
                self.queues
            );
            return None;
        }
        self.rings.get_mut(index as usize)
    }

    fn stop(&mut self, index: u32) {
        if let Some(ring) = self.rings.get_mut(index as usize) {
            ring.started = None;
        }
    }

    fn too_many_queues(&self, asked: u16) {
        warn_limited!(
            QUEUES,
            "QEMU asked for {asked} queues; this daemon serves {}: pass --queues {asked} or num-queues={}",
            self.queues,
            self.queues
        );
    }

    /// Queue `q`'s kicks and finished requests (answered with any status).
    fn activity(&self, q: usize) -> Option<(u64, u64)> {
        use std::sync::atomic::Ordering::Relaxed;
        let m = self.metrics.get(q)?;
        let done = m.requests.iter().map(|c| c.load(Relaxed)).sum::<u64>()
            + m.errors_ioerr.load(Relaxed)
            + m.errors_unsupp.load(Relaxed)
            + m.errors_no_status.load(Relaxed);
        Some((m.kicks.load(Relaxed), done))
    }

    /// Ring `q`'s avail index as this daemon's mapping of guest memory
    /// shows it.
    fn avail_idx(&self, q: usize) -> Option<u16> {
        let avail = self.rings.get(q)?.avail?;
        // avail->idx follows avail->flags.
        let user = avail.checked_add(2)?;
        let r = self
            .regions
            .iter()
            .find(|r| user >= r.user_addr && user - r.user_addr + 2 <= r.size)?;
        let gpa = r.guest_addr.checked_add(user - r.user_addr)?;
        self.mem
            .memory()
            .read_obj::<u16>(GuestAddress(gpa))
            .ok()
            .map(u16::from_le)
    }
}
