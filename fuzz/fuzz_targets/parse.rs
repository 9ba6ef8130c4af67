//! Descriptor chains built from the fuzz input, run through
//! `Request::parse`. The logic lives in `ringblk::virtio::fuzzing` so the
//! corpus also replays under a plain `cargo test` (tests/layers/fuzz_corpus.rs).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    ringblk::virtio::fuzzing::parse_one(data);
});
