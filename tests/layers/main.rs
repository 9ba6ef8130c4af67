//! The layers area: ringblk's library layers driven directly, in the
//! test's own process, against oracles nobody here wrote: the image
//! formats (`ringblk::disk`) under qemu-img and qemu-io, with crashes;
//! the backup's NBD server (`ringblk::nbd`, `ringblk::backup`) under
//! nbdinfo, nbdcopy and qemu-img, and its dirty bitmaps across kill -9;
//! and the replay of the fuzz corpora (`fuzz/corpus/`). No daemon
//! process, no root, no guest.
//!
//! One binary over the test kit (`crates/ringblk-testkit`); each file is a
//! module, so a test is `FILE::NAME` (`cargo test --test layers
//! format::`). A test that needs a process of its own to kill runs this
//! binary again for one test, named by its module path. docs/testing.md
//! says what goes where.

mod backup;
mod format;
mod fuzz_corpus;
