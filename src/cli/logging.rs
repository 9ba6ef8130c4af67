//! The daemon's log: `env_logger` on stderr, filtered by `RUST_LOG`
//! (default `info`; docs/troubleshooting.md).
//!
//! Under systemd, when stderr is the journal's stream (`JOURNAL_STREAM`
//! names stderr's device and inode, sd-daemon(3)), each line starts with
//! its syslog priority (`<3>` error, `<4>` warning, `<6>` info, `<7>`
//! debug and trace), which journald strips and records, so that
//! `journalctl -p warning` finds the warnings; and it carries no timestamp
//! of its own, since the journal stamps every line. A command's own error
//! lines (`main`) are `<3>` there too. Elsewhere a line is
//! `[TIME LEVEL TARGET] MESSAGE`.

use std::io::Write;
use std::os::unix::fs::MetadataExt;

/// What `RUST_LOG` is when it is not set: the daemon's own lines from
/// INFO up; virtio-queue's per-request chatter never.
pub const DEFAULT_FILTER: &str = "info,virtio_queue=off";

/// Installs the logger. Call once, first thing in `main`.
pub fn init() {
    let mut builder =
        env_logger::Builder::from_env(env_logger::Env::default().default_filter_or(DEFAULT_FILTER));
    if under_journal() {
        builder
            .format(|buf, record| writeln!(buf, "<{}>{}", priority(record.level()), record.args()));
    }
    builder.init();
}

/// The syslog priority of a log level (syslog(3): LOG_ERR 3, LOG_WARNING
/// 4, LOG_INFO 6, LOG_DEBUG 7).
pub fn priority(level: log::Level) -> u8 {
    match level {
        log::Level::Error => 3,
        log::Level::Warn => 4,
        log::Level::Info => 6,
        log::Level::Debug | log::Level::Trace => 7,
    }
}

/// Whether stderr is the journal's stream (see [`stderr_is_journal`]),
/// worked out once: then a command's own error lines carry `<3>` too.
pub fn under_journal() -> bool {
    static JOURNAL: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *JOURNAL.get_or_init(stderr_is_journal)
}

/// Whether stderr is the stream systemd connected to the journal:
/// `JOURNAL_STREAM` is `DEVICE:INODE` of that stream, and a process whose
/// stderr was redirected elsewhere (a child, a shell's `2>file`) must not
/// prefix its lines, so both must match stderr's own.
fn stderr_is_journal() -> bool {
    let Some(value) = std::env::var_os("JOURNAL_STREAM") else {
        return false;
    };
    let Some((dev, ino)) = value.to_str().and_then(|v| v.split_once(':')) else {
        return false;
    };
    let (Ok(dev), Ok(ino)) = (dev.parse::<u64>(), ino.parse::<u64>()) else {
        return false;
    };
    // /proc is not needed: fstat of fd 2 through a borrowed handle.
    let stderr = std::io::stderr();
    let meta = {
        use std::os::fd::AsFd;
        stderr
            .as_fd()
            .try_clone_to_owned()
            .map(std::fs::File::from)
            .and_then(|f| f.metadata())
    };
    meta.is_ok_and(|m| m.dev() == dev && m.ino() == ino)
}

#[cfg(test)]
mod tests {
    use super::priority;

    #[test]
    fn priorities_are_syslogs() {
        assert_eq!(priority(log::Level::Error), 3);
        assert_eq!(priority(log::Level::Warn), 4);
        assert_eq!(priority(log::Level::Info), 6);
        assert_eq!(priority(log::Level::Debug), 7);
        assert_eq!(priority(log::Level::Trace), 7);
    }
}
