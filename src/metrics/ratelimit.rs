//! Rate limiting for log lines a guest can trigger: a misbehaving guest
//! must not be able to fill the host's disk through our log.

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

/// `log::warn!` through a [`RateLimiter`], mentioning what was suppressed.
#[macro_export]
macro_rules! warn_limited {
    ($limiter:expr, $($arg:tt)+) => {
        if let Some(suppressed) = $limiter.check() {
            if suppressed > 0 {
                log::warn!("{} ({} similar messages suppressed)", format_args!($($arg)+), suppressed);
            } else {
                log::warn!($($arg)+);
            }
        }
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
}
