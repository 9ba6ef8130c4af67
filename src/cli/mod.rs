//! The command line: `ringblk serve` starts the daemon ([`crate::daemon`],
//! whose options are [`ServeArgs`]); the other subcommands are clients
//! of a running daemon or of the benchmark, here:
//! - [`ctl`]: `ringblk ctl`, the control API's client;
//! - [`stats`]: `ringblk stats`, a table of a running daemon's counters;
//! - [`bench`](mod@bench): `ringblk bench`, which runs the separate `ringblk-bench`;
//! - [`generate`]: `ringblk generate`, the man pages and completions.
//!
//! How every subcommand ends (exit status, error lines) is [`exit`]'s;
//! the log's format (journald's priorities under systemd) is
//! [`logging`]'s.

pub mod backup;
pub mod bench;
pub mod ctl;
pub mod exit;
pub mod generate;
pub mod logging;
pub mod stats;

use clap::{Parser, Subcommand};

pub use crate::daemon::ServeArgs;

#[derive(Debug, Parser)]
#[command(
    name = "ringblk",
    version,
    about = "A vhost-user-blk backend built on io_uring"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Serve an image file or block device as a vhost-user-blk device.
    Serve(Box<ServeArgs>),
    /// Print the counters of a running daemon (started with --metrics or
    /// --api); `ctl --api PATH stats` is the same.
    Stats(stats::StatsArgs),
    /// Control a running daemon over its --api socket: status, verbs,
    /// resize, qos, stats.
    Ctl(ctl::CtlArgs),
    /// Back up a running daemon's disk into a directory of qcow2 files, a
    /// full backup and then incremental ones (a dirty bitmap tracks the
    /// changes between them), with checksums; `backup verify|restore|prune`
    /// on that directory.
    Backup(backup::BackupArgs),
    /// Load generator for any vhost-user-blk socket, and a side-by-side
    /// comparison with qemu-storage-daemon and the host's own io_uring:
    /// runs ringblk-bench with these arguments.
    #[command(disable_help_flag = true)]
    Bench(bench::BenchArgs),
    /// Write the man pages and shell completions (bash, zsh, fish) made
    /// from these definitions: what the Debian package installs, for a
    /// `cargo install` to install too.
    Generate(generate::GenerateArgs),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn later_serve_options_override_earlier_ones() {
        let cli =
            Cli::try_parse_from(["ringblk", "serve", "--poll-us=0", "--poll-us", "50"]).unwrap();
        match cli.command {
            Command::Serve(a) => assert_eq!(a.poll_us, 50),
            other => panic!("parsed as {other:?}"),
        }
    }

    #[test]
    fn qos_flags_fill_the_limits() {
        let cli = Cli::try_parse_from([
            "ringblk",
            "serve",
            "--iops",
            "2000",
            "--read-bps",
            "64M",
            "--write-bps",
            "0",
            "--write-iops-max",
            "30",
        ])
        .unwrap();
        let Command::Serve(a) = cli.command else {
            panic!("not serve");
        };
        let l = crate::qos::QosLimits {
            bps_write: 5,
            iops_read: 7,
            ..Default::default()
        }
        .with(&a.qos);
        assert_eq!(l.iops_total, 2000);
        assert_eq!(l.bps_read, 64 << 20);
        assert_eq!(l.bps_write, 0, "0 removes a limit");
        assert_eq!(l.iops_read, 7, "not given: kept");
        assert_eq!(l.iops_write_max, 30);
        assert!(Cli::try_parse_from(["ringblk", "serve", "--bps", "1X"]).is_err());
        assert!(Cli::try_parse_from(["ringblk", "serve", "--iops", "-1"]).is_err());
    }

    #[test]
    fn cli_is_consistent() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }
}
