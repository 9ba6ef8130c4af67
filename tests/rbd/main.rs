//! The RBD area: the Ceph RBD engine (`serve --image rbd:POOL/IMAGE`)
//! against a single-node cluster this binary starts on first use and
//! stops when it exits (the kit's `ceph`): over the socket, under a real
//! guest, and through a live migration. Needs the daemon built with
//! `--features rbd` (`required-features`), as scripts/test.sh builds it:
//!
//! ```sh
//! cargo test --features rbd --test rbd
//! ```
//!
//! Guests run one at a time (`vm::one_guest`), and the socket-level tests
//! never beside one (`vm::no_guest`): a guest under TCG takes both cores,
//! and these tests have deadlines of their own.
//!
//! One binary over the test kit (`crates/ringblk-testkit`); each file is a
//! module, so a test is `FILE::NAME`. docs/testing.md says what goes
//! where.

mod guest_rbd;
mod migration;
mod rbd;
