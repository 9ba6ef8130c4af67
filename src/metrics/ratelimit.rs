//! Rate limiting for log lines a guest or a front-end can trigger: neither
//! must be able to fill the host's disk through our log.
//!
//! A [`RateLimiter`] belongs to one owner (a queue's worker, an engine); a
//! [`SharedRateLimiter`] is for lines with no such owner, e.g. the relay's
//! and the device's, which a front-end can repeat on every message and on
//! every new connection: it lives in a `static`, so reconnecting does not
//! start a fresh allowance.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Allows `burst` messages per `period`, counts the rest, and reports the
/// count with the next message let through.
#[derive(Debug)]
pub struct RateLimiter {
    period: Duration,
    burst: u32,
    window_start: Option<Instant>,
    used: u32,
    suppressed: u64,
}

impl RateLimiter {
    pub const fn new(burst: u32, period: Duration) -> RateLimiter {
        RateLimiter {
            period,
            burst,
            window_start: None,
            used: 0,
            suppressed: 0,
        }
    }

    /// Returns `Some(suppressed_since_last)` if a message may be logged now.
    pub fn check(&mut self) -> Option<u64> {
        let now = Instant::now();
        match self.window_start {
            Some(t) if now.duration_since(t) < self.period => {}
            _ => {
                self.window_start = Some(now);
                self.used = 0;
            }
        }
        if self.used < self.burst {
            self.used += 1;
            Some(std::mem::take(&mut self.suppressed))
        } else {
            self.suppressed += 1;
            None
        }
    }
}

/// A [`RateLimiter`] that can live in a `static` and be used from any
/// thread.
#[derive(Debug)]
pub struct SharedRateLimiter(Mutex<RateLimiter>);

impl SharedRateLimiter {
    pub const fn new(burst: u32, period: Duration) -> SharedRateLimiter {
        SharedRateLimiter(Mutex::new(RateLimiter::new(burst, period)))
    }

    /// As [`RateLimiter::check`].
    pub fn check(&self) -> Option<u64> {
        // A thread that panicked while holding it left a consistent limiter.
        self.0.lock().unwrap_or_else(|p| p.into_inner()).check()
    }
}

/// `log::log!` at `level` through a [`RateLimiter`] or a
/// [`SharedRateLimiter`], mentioning what was suppressed.
#[macro_export]
macro_rules! log_limited {
    ($level:expr, $limiter:expr, $($arg:tt)+) => {
        if let Some(suppressed) = $limiter.check() {
            if suppressed > 0 {
                log::log!($level, "{} ({} similar messages suppressed)", format_args!($($arg)+), suppressed);
            } else {
                log::log!($level, $($arg)+);
            }
        }
    };
}

/// `log::warn!` through a rate limiter ([`log_limited!`]).
#[macro_export]
macro_rules! warn_limited {
    ($limiter:expr, $($arg:tt)+) => {
        $crate::log_limited!(log::Level::Warn, $limiter, $($arg)+)
    };
}

/// `log::info!` through a rate limiter ([`log_limited!`]).
#[macro_export]
macro_rules! info_limited {
    ($limiter:expr, $($arg:tt)+) => {
        $crate::log_limited!(log::Level::Info, $limiter, $($arg)+)
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_and_reports_suppressed() {
        let mut r = RateLimiter::new(2, Duration::from_secs(3600));
        assert_eq!(r.check(), Some(0));
        assert_eq!(r.check(), Some(0));
        assert_eq!(r.check(), None);
        assert_eq!(r.check(), None);
        r.window_start = Some(Instant::now() - Duration::from_secs(7200));
        assert_eq!(r.check(), Some(2));
    }

    #[test]
    fn a_shared_limiter_limits_across_threads() {
        static SHARED: SharedRateLimiter = SharedRateLimiter::new(3, Duration::from_secs(3600));
        let allowed: usize = (0..4)
            .map(|_| std::thread::spawn(|| (0..10).filter(|_| SHARED.check().is_some()).count()))
            .map(|t| t.join().unwrap())
            .sum();
        assert_eq!(allowed, 3);
    }
}
