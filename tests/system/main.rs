//! The system area: tests that need root or change the machine: loop
//! devices, a tmpfs mount, a cgroup, other users, the Debian package
//! installed and removed. Without root they skip,
//! except where `CI` is set (CI runs as root): there they fail.
//!
//! One binary over the test kit (`crates/ringblk-testkit`); each file is a
//! module, so a test is `FILE::NAME` (`cargo test --test system
//! block_device::`). What the machine shares, the tests share with care:
//! `losetup --find` goes through the kit's [`ringblk_testkit::LoopDevice`],
//! one at a time; a cgroup or a mount is the test's own, named after it.
//! docs/testing.md says what goes where.

mod backing_errors;
mod block_device;
mod cpu_quota;
mod default_paths;
mod package;
mod unprivileged;
