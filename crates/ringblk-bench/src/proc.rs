//! Processes and CPUs: CPU time from /proc, pinning, and stopping children
//! without ever waiting on them forever.

use std::io;
use std::path::Path;
use std::process::{Child, ExitStatus};
use std::time::{Duration, Instant};

/// CPU seconds (user + system) process `pid` has used so far, all threads
/// included: /proc/PID/stat sums the live threads and every thread that has
/// exited, so short-lived io_uring workers (iou-wrk, iou-sqp) are counted.
pub fn cpu_seconds(pid: u32) -> io::Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    parse_stat_ticks(&stat)
        .map(|ticks| ticks as f64 / clock_ticks_per_second())
        .ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("/proc/{pid}/stat: unexpected format"),
            )
        })
}

/// utime + stime from a /proc/PID/stat line. The command name (field 2) may
/// hold spaces and parentheses, so fields are counted after the last ')'.
fn parse_stat_ticks(stat: &str) -> Option<u64> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace();
    // After ')': field 3 (state) is index 0, so utime (14) is index 11.
    let utime: u64 = fields.nth(11)?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some(utime + stime)
}

fn clock_ticks_per_second() -> f64 {
    // SAFETY: sysconf only reads a configuration value; no memory is passed.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 { t as f64 } else { 100.0 }
}

/// Waits for `child` to exit for at most `timeout`.
pub fn wait_timeout(child: &mut Child, timeout: Duration) -> io::Result<Option<ExitStatus>> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(Some(status));
        }
        if Instant::now() >= deadline {
            return Ok(None);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Asks `child` to stop (SIGTERM), and kills it (SIGKILL) if it has not
/// exited after `grace`. Returns how it ended and whether it had to be killed.
pub fn stop(child: &mut Child, grace: Duration) -> io::Result<(ExitStatus, bool)> {
    if let Some(status) = child.try_wait()? {
        return Ok((status, false));
    }
    let pid = libc::pid_t::try_from(child.id()).map_err(io::Error::other)?;
    // SAFETY: kill() takes no memory; `pid` is our own child, which has not
    // been reaped yet (try_wait above returned None), so the pid cannot
    // have been reused by another process.
    unsafe { libc::kill(pid, libc::SIGTERM) };
    if let Some(status) = wait_timeout(child, grace)? {
        return Ok((status, false));
    }
    child.kill()?;
    Ok((child.wait()?, true))
}

/// A child that is stopped (SIGTERM, then SIGKILL) when dropped, so an
/// early return or a panic never leaves a backend running.
pub struct Guard(pub Child);

impl Guard {
    /// Stops the child now and says how it ended.
    pub fn stop(mut self, grace: Duration) -> io::Result<(ExitStatus, bool)> {
        stop(&mut self.0, grace)
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        let _ = stop(&mut self.0, Duration::from_secs(2));
    }
}

/// The last `n` lines of a log file, for error reports.
pub fn tail(path: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// Why a process that wrote `path` failed: a line of its own that starts
/// with `error:` (a command-line parser's message, which the usage text
/// after it would push out of a tail), else the last three lines.
pub fn reason(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    text.lines()
        .find(|l| l.trim_start().starts_with("error:"))
        .map_or_else(|| tail(path, 3), |l| l.trim().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_line_with_odd_command_name() {
        let line = "1234 (a (b) c) S 1 2 3 4 5 6 7 8 9 10 250 75 0 0 20 0 5 0";
        assert_eq!(parse_stat_ticks(line), Some(325));
        assert_eq!(parse_stat_ticks("garbage"), None);
    }

    #[test]
    fn reason_prefers_the_parser_s_error_line() {
        let dir = tempfile::tempdir().expect("tempdir");
        let log = dir.path().join("log");
        std::fs::write(
            &log,
            "error: unexpected argument '--format' found\n\nUsage: ringblk serve [OPTIONS]\n\nFor more information, try '--help'.\n",
        )
        .expect("write");
        assert_eq!(reason(&log), "error: unexpected argument '--format' found");
        std::fs::write(&log, "a\nb\nc\nringblk: no such image\n").expect("write");
        assert_eq!(reason(&log), "b\nc\nringblk: no such image");
    }

    #[test]
    fn own_cpu_time_is_readable() {
        let t = cpu_seconds(std::process::id()).expect("own stat");
        assert!(t >= 0.0);
    }

    #[test]
    fn stop_kills_what_ignores_sigterm() {
        let mut child = std::process::Command::new("sh")
            .args(["-c", "trap '' TERM; sleep 30"])
            .spawn()
            .expect("sh");
        std::thread::sleep(Duration::from_millis(100));
        let (_, killed) = stop(&mut child, Duration::from_millis(200)).expect("stop");
        assert!(killed);
    }
}
