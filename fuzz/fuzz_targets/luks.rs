//! LUKS1 and LUKS2 headers from the fuzz input (the start of an image,
//! zeros after it), parsed and, when every cost they name is tiny, opened
//! with a passphrase. The logic lives in `ringblk::crypto::luks::fuzzing`
//! so the corpus also replays under a plain `cargo test`
//! (tests/layers/fuzz_corpus.rs).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    ringblk::crypto::luks::fuzzing::run_one(data);
});
