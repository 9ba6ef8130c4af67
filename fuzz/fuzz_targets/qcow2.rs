//! qcow2 images built from the fuzz input, opened and mapped through the
//! format layer. The logic lives in `ringblk::disk::fuzzing` so the
//! corpus also replays under a plain `cargo test` (tests/layers/fuzz_corpus.rs).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    ringblk::disk::fuzzing::run_one(data);
});
