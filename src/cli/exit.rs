//! How a command ends: its exit status, and what it says on stderr. One
//! convention for every subcommand (docs/operations.md, "Errors and exit
//! status"):
//!
//! - 0: it did what was asked, or the reader of its output went away
//!   (`ringblk stats --interval 1 | head -3`): a closed pipe ends it
//!   quietly, as it ends `cat` or `seq`;
//! - 1: a runtime error: what the command needed is not there or failed
//!   (an image that does not exist, a socket in use, no daemon at the
//!   address). One line on stderr: `ringblk: MESSAGE`;
//! - 2: a usage error: the command line itself is wrong (a mistyped
//!   value, a missing or conflicting flag, a value out of range). Parsed
//!   by clap or checked by us, it is printed the way clap prints its own:
//!   `error: MESSAGE` naming the flag, the usage line, and a pointer to
//!   `--help`.

use std::io::Write;

/// Why a command did not finish normally.
#[derive(Debug)]
pub enum Failure {
    /// The command line is wrong (exit status 2).
    Usage(String),
    /// Something the command needed failed (exit status 1).
    Runtime(String),
    /// Standard output was closed by its reader: not an error (exit 0).
    Closed,
}

impl Failure {
    /// The process exit status for this failure.
    pub fn status(&self) -> i32 {
        match self {
            Failure::Usage(_) => 2,
            Failure::Runtime(_) => 1,
            Failure::Closed => 0,
        }
    }
}

impl From<String> for Failure {
    fn from(message: String) -> Failure {
        Failure::Runtime(message)
    }
}

/// Writes `text` to standard output and flushes it. A reader that closed
/// the pipe (EPIPE: Rust ignores SIGPIPE, so `print!` would panic) is
/// [`Failure::Closed`]; any other write error is a runtime error.
pub fn out(text: &str) -> Result<(), Failure> {
    let mut stdout = std::io::stdout().lock();
    stdout
        .write_all(text.as_bytes())
        .and_then(|()| stdout.flush())
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::BrokenPipe => Failure::Closed,
            _ => Failure::Runtime(format!("writing to standard output: {e}")),
        })
}

/// How `serve` ends: its usage errors are the command line's (2), the
/// rest runtime errors (1).
impl From<crate::daemon::DaemonError> for Failure {
    fn from(e: crate::daemon::DaemonError) -> Self {
        match e {
            crate::daemon::DaemonError::Usage(m) => Failure::Usage(m),
            other => Failure::Runtime(other.to_string()),
        }
    }
}
