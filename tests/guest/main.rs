//! The guest area: a real Linux guest under QEMU (TCG) on a disk ringblk
//! serves; two QEMUs for live migration; QEMU set up wrong, for the
//! daemon's hints. Each guest keeps both cores of a
//! small machine busy, so guests run one at a time (the kit's
//! `vm::one_guest` lock, across threads and binaries); a test takes
//! 10-60 s.
//!
//! The guest boots the kernel and initramfs of `scripts/guest-assets.sh`,
//! whose `/init` is `init.sh`, next to this file. The tests skip only
//! where QEMU cannot run at all, never where `CI` is set.
//!
//! One binary over the test kit (`crates/ringblk-testkit`); each file is a
//! module, so a test is `FILE::NAME` (`cargo test --test guest
//! migration::`). docs/testing.md says what goes where.

mod backup;
mod guest;
mod guest_resize;
mod luks;
mod migration;
mod qcow2;
mod setup_hints;
