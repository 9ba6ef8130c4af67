//! What a server sends, from the fuzz input, to the NBD client that
//! `ringblk backup` copies with: its handshake, a block status and a read
//! must end in an answer or an error, never a panic or an allocation the
//! server chose. The logic lives in `ringblk::nbd::fuzzing` so the corpus
//! also replays under a plain `cargo test` (tests/layers/fuzz_corpus.rs).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    ringblk::nbd::fuzzing::client_one(data);
});
