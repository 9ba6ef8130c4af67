//! The socket area: a `ringblk` process driven from outside: `serve` over
//! its vhost-user socket by libblkio or the kit's raw front-end, its
//! control API and metrics endpoints, its signals and socket activation,
//! the command line's errors. Fast; needs neither root, nor a guest, nor
//! Ceph (one control API test needs root for a loop device).
//!
//! One binary over the test kit (`crates/ringblk-testkit`); each file is a
//! module, so a test is `FILE::NAME`:
//!
//! ```sh
//! cargo test --test socket                         # the whole area
//! cargo test --test socket qos::                   # one file
//! cargo test --test socket -- --exact blkio_client::readonly_export
//! ```
//!
//! The tests of all files share one process and run on parallel threads:
//! none may change what the process shares (umask, rlimits, environment,
//! cwd, signal dispositions, its own seccomp or Landlock state). What a
//! daemon needs changed is changed in the child (a `pre_exec` hook or a
//! wrapper such as `prlimit`), and the kit's daemons inherit no other
//! test's descriptors. docs/testing.md says what goes where.

mod activation;
mod backup;
mod backup_command;
mod backup_interrupted;
mod bench_launcher;
mod bitmap_files;
mod blkio_client;
mod bounce_limit;
mod churn;
mod cli_errors;
mod config_change;
mod control_api;
mod dirty_log;
mod disconnect;
mod durability;
mod hostile_frontend;
mod http_limits;
mod image_lock;
mod inflight_recovery;
mod kit;
mod latency;
mod log_limits;
mod lost_interrupt;
mod luks;
mod luks_key;
mod memory_slots;
mod qcow2;
mod qcow2_luks;
mod qos;
mod sandbox;
mod seccomp;
mod sighup;
mod socket_mode;
mod stream;
mod trap;
mod untrusted_files;
