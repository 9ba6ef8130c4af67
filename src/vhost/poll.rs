//! Busy-polling that is a good neighbour.
//!
//! The window adapts after QEMU's `poll-max-ns`: it grows while sleeping
//! would have been short (polling a little longer would have caught the
//! event) and shrinks when the wait was longer than the maximum (polling
//! was wasted CPU). On top of that a worker stops polling at once when
//! polling hurts (unless `--no-poll-checks`):
//! - it was preempted: two spin iterations [`PREEMPT_GAP`] apart mean the
//!   CPU went to someone else meanwhile, who wants it (a vCPU, another
//!   daemon); the window ends and halves. So does a window whose thread
//!   was switched out involuntarily since the last look (`getrusage`'s
//!   `ru_nivcsw`, read at most every 50 µs): then it does not poll at all;
//! - another ringblk thread is polling on its CPU ([`CpuClaim`]): two
//!   pollers on one CPU only take turns by preemption; it does not poll;
//! - the window keeps expiring with nothing found: after [`MISS_LIMIT`]
//!   empty windows in a row the window halves.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

const GROW: u32 = 2;
const SHRINK: u32 = 2;
/// The first window after a shrink to zero.
const START: Duration = Duration::from_micros(4);
/// A gap between two spin iterations this long means the thread was
/// preempted: an iteration takes well under a microsecond (a clock read
/// from the vDSO and two loads), even with the clock read as a syscall.
pub const PREEMPT_GAP: Duration = Duration::from_micros(10);
/// Shortest time between two looks at the thread's context switches (a
/// syscall each): a window at each request at depth 1 would otherwise pay
/// one per I/O, and the preemptions that matter last a scheduler tick.
const NIVCSW_EVERY: Duration = Duration::from_micros(50);
/// Empty windows in a row after which the window halves.
const MISS_LIMIT: u32 = 4;

#[derive(Debug)]
pub struct AdaptivePoll {
    max: Duration,
    cur: Duration,
    slept_at: Option<Instant>,
    /// Windows in a row that expired with nothing found.
    misses: u32,
    /// The neighbour checks are on.
    checks: bool,
    /// The thread's involuntary context switches when last looked at,
    /// and when that was.
    nivcsw: Option<u64>,
    nivcsw_at: Option<Instant>,
}

/// How a window ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Work showed up.
    Found,
    /// The window ran out with nothing found.
    Expired,
    /// The thread was preempted while polling.
    Preempted,
}

impl AdaptivePoll {
    pub fn new(max: Duration, checks: bool) -> AdaptivePoll {
        AdaptivePoll {
            max,
            cur: max,
            slept_at: None,
            misses: 0,
            checks,
            nivcsw: None,
            nivcsw_at: None,
        }
    }

    /// Whether the neighbour checks are on.
    pub fn checks(&self) -> bool {
        self.checks
    }

    /// Whether the thread was switched out involuntarily since the last
    /// look (someone else wanted its CPU): then polling now would take the
    /// CPU from them. Looks at most every [`NIVCSW_EVERY`]; false when it
    /// did not look or cannot know.
    pub fn preempted_since(&mut self) -> bool {
        let t = Instant::now();
        if self
            .nivcsw_at
            .is_some_and(|at| t.saturating_duration_since(at) < NIVCSW_EVERY)
        {
            return false;
        }
        self.nivcsw_at = Some(t);
        let now = involuntary_switches();
        let before = std::mem::replace(&mut self.nivcsw, now);
        matches!((before, now), (Some(b), Some(n)) if n > b)
    }

    /// The window to poll for now, or None when polling is off or shrunk away.
    pub fn window(&self) -> Option<Duration> {
        (!self.cur.is_zero()).then_some(self.cur)
    }

    /// A window ended: adapt to how.
    pub fn ended(&mut self, how: Outcome) {
        match how {
            Outcome::Found => self.misses = 0,
            Outcome::Expired if self.checks => {
                self.misses += 1;
                if self.misses >= MISS_LIMIT {
                    self.misses = 0;
                    self.shrink();
                }
            }
            Outcome::Expired => {}
            Outcome::Preempted => self.shrink(),
        }
    }

    fn shrink(&mut self) {
        self.cur /= SHRINK;
        if self.cur < START {
            self.cur = Duration::ZERO;
        }
    }

    /// The worker goes to sleep in epoll.
    pub fn sleeping(&mut self) {
        if !self.max.is_zero() {
            self.slept_at = Some(Instant::now());
        }
    }

    /// The worker woke up: adapt the window to how long it slept.
    pub fn woke_up(&mut self) {
        let Some(t) = self.slept_at.take() else {
            return;
        };
        let slept = t.elapsed();
        if slept <= self.max {
            // A longer window would have caught this event without sleeping.
            if self.cur < slept {
                self.cur = (self.cur * GROW).max(START).min(self.max);
            }
        } else {
            self.shrink();
        }
    }
}

/// Involuntary context switches of the calling thread so far.
fn involuntary_switches() -> Option<u64> {
    let mut ru = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: RUSAGE_THREAD names the calling thread; the kernel writes one
    // `rusage` into `ru`, which is that large.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_THREAD, ru.as_mut_ptr()) };
    if rc != 0 {
        return None;
    }
    // SAFETY: getrusage succeeded, so it filled `ru` (and all-zeroes, its
    // starting point, is a valid rusage anyway).
    let ru = unsafe { ru.assume_init() };
    u64::try_from(ru.ru_nivcsw).ok()
}

/// Most CPUs the claims cover; pollers on CPUs past it poll unclaimed.
const MAX_CPUS: usize = 1024;

/// Which poller (a [`CpuClaim::token`]) polls on each CPU now; 0: none.
static CLAIMS: [AtomicU64; MAX_CPUS] = [const { AtomicU64::new(0) }; MAX_CPUS];
static NEXT_TOKEN: AtomicU64 = AtomicU64::new(1);

/// A poller's claim on the CPU it polls on, so that a second ringblk
/// thread (of this process) on the same CPU sleeps instead of polling
/// against it. Released when dropped. A thread that migrates while it
/// polls keeps a stale claim until its window ends (at most `--poll-us`).
pub struct CpuClaim {
    slot: Option<&'static AtomicU64>,
    token: u64,
}

impl CpuClaim {
    /// A token naming one poller, for [`CpuClaim::take`].
    pub fn token() -> u64 {
        NEXT_TOKEN.fetch_add(1, Ordering::Relaxed)
    }

    /// Claims the CPU the caller runs on for `token`; None when another
    /// poller holds it. Where the CPU is unknown (or past [`MAX_CPUS`]),
    /// the claim is granted and covers nothing.
    pub fn take(token: u64) -> Option<CpuClaim> {
        // SAFETY: sched_getcpu takes no arguments and only returns a number
        // (-1 on error).
        let cpu = unsafe { libc::sched_getcpu() };
        let slot = usize::try_from(cpu).ok().and_then(|c| CLAIMS.get(c));
        let Some(slot) = slot else {
            return Some(CpuClaim { slot: None, token });
        };
        match slot.compare_exchange(0, token, Ordering::Acquire, Ordering::Relaxed) {
            Ok(_) => Some(CpuClaim {
                slot: Some(slot),
                token,
            }),
            Err(holder) if holder == token => Some(CpuClaim { slot: None, token }),
            Err(_) => None,
        }
    }
}

impl Drop for CpuClaim {
    fn drop(&mut self) {
        if let Some(slot) = self.slot {
            let _ = slot.compare_exchange(self.token, 0, Ordering::Release, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn off_stays_off() {
        let mut p = AdaptivePoll::new(Duration::ZERO, true);
        p.sleeping();
        p.woke_up();
        assert_eq!(p.window(), None);
    }

    #[test]
    fn shrinks_after_long_sleeps_and_grows_after_short_ones() {
        let mut p = AdaptivePoll::new(Duration::from_micros(64), true);
        for _ in 0..8 {
            p.slept_at = Some(Instant::now() - Duration::from_millis(10));
            p.woke_up();
        }
        assert_eq!(p.window(), None);
        p.slept_at = Some(Instant::now() - Duration::from_micros(20));
        p.woke_up();
        assert_eq!(p.window(), Some(START));
        for _ in 0..8 {
            p.slept_at = Some(Instant::now() - Duration::from_micros(60));
            p.woke_up();
        }
        assert_eq!(p.window(), Some(Duration::from_micros(64)));
    }

    #[test]
    fn preemption_halves_and_empty_windows_shrink_only_with_checks() {
        let mut p = AdaptivePoll::new(Duration::from_micros(32), true);
        p.ended(Outcome::Preempted);
        assert_eq!(p.window(), Some(Duration::from_micros(16)));
        for _ in 0..MISS_LIMIT - 1 {
            p.ended(Outcome::Expired);
        }
        p.ended(Outcome::Found);
        p.ended(Outcome::Expired);
        assert_eq!(
            p.window(),
            Some(Duration::from_micros(16)),
            "a hit resets the streak"
        );
        for _ in 0..MISS_LIMIT * 3 {
            p.ended(Outcome::Expired);
        }
        assert_eq!(p.window(), None);

        let mut off = AdaptivePoll::new(Duration::from_micros(32), false);
        for _ in 0..MISS_LIMIT * 3 {
            off.ended(Outcome::Expired);
        }
        assert_eq!(off.window(), Some(Duration::from_micros(32)));
    }

    #[test]
    fn involuntary_switches_are_read() {
        assert!(involuntary_switches().is_some());
        let mut p = AdaptivePoll::new(Duration::from_micros(32), true);
        // The first look has nothing to compare with.
        assert!(!p.preempted_since());
    }

    #[test]
    fn one_poller_per_cpu() {
        // Pinned, so both claims name the same CPU.
        let allowed = crate::cpu::allowed_cpus().unwrap();
        crate::cpu::pin_current_thread(allowed[0]).unwrap();
        let (a, b) = (CpuClaim::token(), CpuClaim::token());
        let held = CpuClaim::take(a).expect("a free CPU can be claimed");
        assert!(CpuClaim::take(b).is_none(), "a second poller is refused");
        drop(held);
        assert!(CpuClaim::take(b).is_some(), "released on drop");
    }
}
