//! A client stream generated from the fuzz input, served by the NBD
//! server from memory, its output checked as a client would. The logic
//! lives in `ringblk::nbd::fuzzing` so the corpus also replays under a
//! plain `cargo test` (tests/layers/fuzz_corpus.rs).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    ringblk::nbd::fuzzing::session_one(data);
});
