//! What a completed request promises about the image, checked by killing
//! the daemon with SIGKILL right after the completion and reading the image
//! file from the host:
//! - write-back cache (the default): a write whose FLUSH has completed is
//!   in the image;
//! - `--writethrough`: every acknowledged write is in the image, no FLUSH
//!   needed.
//!
//! Honest scope: SIGKILL ends the process, not the machine. The host's
//! page cache survives it, so these tests prove ordering and acknowledgment
//! semantics (nothing is acknowledged before the kernel has the data; no
//! completion is reported for data still sitting in a daemon-side buffer
//! or queue), not that the data reached the platter. That part is the
//! fdatasync/RWF_DSYNC the daemon issues, which only a power cut (or a
//! fault-injecting block device) could test.

use std::time::Duration;

use ringblk_testkit::{
    Client, Daemon, DaemonOptions, MIB, Op, assert_pattern, pattern, sparse_image, test_dir,
};

const IMAGE_SIZE: u64 = 64 * MIB;
const CHUNK: usize = 128 * 1024;
/// Written in one batch, so many writes are in flight at once.
const BATCH: usize = 16;

/// Writes BATCH chunks in one batch, waits for their completions (and then
/// a FLUSH's, with `flush`), SIGKILLs the daemon at once, and checks the
/// image file holds all of it.
fn write_kill_verify(extra_args: &[&str], flush: bool) {
    let dir = test_dir();
    let image = sparse_image(dir.path(), "disk.img", IMAGE_SIZE);
    let mut d = Daemon::start_in(
        dir.path(),
        DaemonOptions {
            image: Some(image),
            args: extra_args,
            ..DaemonOptions::default()
        },
    );
    let seed = 0xd0_0000 + u64::from(flush);
    let base = 5 * MIB + 4096;
    let mut c = Client::connect(&d.socket, BATCH * CHUNK);
    let data = pattern(seed, base, BATCH * CHUNK);
    c.buf()[..data.len()].copy_from_slice(&data);
    let writes: Vec<Op> = (0..BATCH)
        .map(|i| Op::Write {
            offset: base + (i * CHUNK) as u64,
            buf_off: i * CHUNK,
            len: CHUNK,
        })
        .collect();
    assert_eq!(c.batch(&writes), vec![0; BATCH], "writes");
    if flush {
        // A FLUSH covers the writes completed before it was submitted.
        assert_eq!(c.flush(), 0, "flush");
    }
    let st = d.signal_and_wait(libc::SIGKILL, Duration::from_secs(10));
    assert_eq!(st.code(), None, "the daemon was not killed: {st}");
    drop(c);

    let got = d.read_image(base, BATCH * CHUNK);
    assert_pattern("image after SIGKILL", seed, base, &got);
}

#[test]
fn flushed_writes_survive_sigkill() {
    write_kill_verify(&[], true);
}

#[test]
fn writethrough_writes_survive_sigkill_without_flush() {
    write_kill_verify(&["--writethrough"], false);
}

#[test]
fn writethrough_with_direct_io() {
    // O_DIRECT: no host page cache between the daemon and the file system.
    write_kill_verify(&["--writethrough", "--direct"], false);
}
