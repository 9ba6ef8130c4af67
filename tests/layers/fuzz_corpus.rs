//! Replays the `parse` fuzz corpus (fuzz/corpus/parse) through the fuzz
//! target's logic, on stable and without libFuzzer: every input that ever
//! found new coverage stays a regression test.

use std::collections::BTreeSet;
use std::path::Path;

use ringblk::virtio::RequestKind;
use ringblk::virtio::fuzzing::parse_one;

#[test]
fn corpus_replays_cleanly() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/parse");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    let mut seen = BTreeSet::new();
    for path in &files {
        let data = std::fs::read(path).unwrap();
        // parse_one panics, naming the broken promise, on a bad outcome.
        for outcome in parse_one(&data) {
            seen.insert(match outcome {
                Ok(RequestKind::Read { .. }) => "read".to_string(),
                Ok(RequestKind::Write { .. }) => "write".to_string(),
                Ok(RequestKind::Flush) => "flush".to_string(),
                Ok(RequestKind::GetId) => "get-id".to_string(),
                Ok(RequestKind::Discard(_)) => "discard".to_string(),
                Ok(RequestKind::WriteZeroes(_)) => "write-zeroes".to_string(),
                Err(e) => format!("{e:?}").split('(').next().unwrap_or("").to_string(),
            });
        }
    }
    assert!(files.len() >= 20, "only {} corpus files", files.len());
    // The corpus reaches every request type and every refusal.
    for want in [
        "read",
        "write",
        "flush",
        "get-id",
        "discard",
        "write-zeroes",
        "IllFormedChain",
        "ShortHeader",
        "BadAddress",
        "WrongDirection",
        "BadLength",
        "Misaligned",
        "OutOfRange",
        "TooManySegments",
        "TooLarge",
        "TooManyRanges",
        "RangeTooLong",
        "ReadOnly",
        "UnsupportedFlags",
        "UnsupportedType",
    ] {
        assert!(
            seen.contains(want),
            "no corpus input gives {want}; saw {seen:?}"
        );
    }
}

/// Replays the `nbd` fuzz corpus (fuzz/corpus/nbd) through the NBD
/// server's fuzz logic (`ringblk::nbd::fuzzing`), which checks every reply
/// as a client would, and checks that the corpus still reaches each
/// option, command and way a session ends.
#[test]
fn nbd_corpus_replays_cleanly() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/nbd");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    let mut seen = BTreeSet::new();
    for path in &files {
        let data = std::fs::read(path).unwrap();
        // session_one panics, naming the broken promise, on a bad reply.
        seen.extend(ringblk::nbd::fuzzing::session_one(&data));
    }
    assert!(files.len() >= 15, "only {} corpus files", files.len());
    for want in [
        "go:ack",
        "info:ack",
        "list:ack",
        "structured:ack",
        "set-meta:ack",
        "list-meta:ack",
        "abort:ack",
        "unknown-option:err1",
        "export-name",
        "read:data",
        "read:simple:0",
        "read:error:22",
        "read:error:5",
        "block-status",
        "write:simple:1",
        "trim:error:1",
        "flush:simple:0",
        "unknown-command:error:22",
        "bad-client-flags",
        "non-fixed-refused",
        "corrupted",
        "end:disconnect",
        "end:closed",
        "end:protocol",
    ] {
        assert!(
            seen.contains(want),
            "no corpus input gives {want}; saw {seen:?}"
        );
    }
}

/// Replays the `qcow2` fuzz corpus (fuzz/corpus/qcow2) through the format
/// layer's fuzz logic: images refused at open, served, and served with
/// requests failing on a corrupt table all stay covered.
#[test]
fn qcow2_corpus_replays_cleanly() {
    use ringblk::disk::fuzzing::{Outcome, run_one};

    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/qcow2");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    let (mut refused, mut served, mut failing) = (0, 0, 0);
    for path in &files {
        let data = std::fs::read(path).unwrap();
        // run_one panics, naming the broken promise, on a bad outcome.
        match run_one(&data) {
            Outcome::Refused(_) => refused += 1,
            Outcome::Served { ok, failed } => {
                assert!(ok + failed > 0, "{}: nothing was done", path.display());
                served += 1;
                if failed > 0 {
                    failing += 1;
                }
            }
        }
    }
    assert!(files.len() >= 10, "only {} corpus files", files.len());
    assert!(
        refused > 0 && served > 0 && failing > 0,
        "refused {refused}, served {served}, failing {failing}"
    );
}

/// Replays the `luks` fuzz corpus (fuzz/corpus/luks) through the LUKS
/// parser's fuzz logic: headers refused for each kind of reason, parsed
/// with costs too high to try, and opened or not with a passphrase all
/// stay covered.
#[test]
fn luks_corpus_replays_cleanly() {
    use ringblk::crypto::luks::fuzzing::{Outcome, run_one};

    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/luks");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    let mut seen = BTreeSet::new();
    for path in &files {
        let data = std::fs::read(path).unwrap();
        // run_one panics, naming the broken promise, on a bad outcome.
        seen.insert(match run_one(&data) {
            Outcome::Refused(why) => format!("refused:{why}"),
            Outcome::Parsed => "parsed".to_string(),
            Outcome::Tried(Ok(())) => "opened".to_string(),
            Outcome::Tried(Err(why)) => format!("not-opened:{why}"),
        });
    }
    assert!(files.len() >= 15, "only {} corpus files", files.len());
    for want in [
        "refused:NotLuks",
        "refused:Corrupt",
        "refused:Unsupported",
        "refused:TooCostly",
        "parsed",
        "opened",
        "not-opened:WrongPassphrase",
    ] {
        assert!(
            seen.contains(want),
            "no corpus input gives {want}; saw {seen:?}"
        );
    }
}

/// Replays the `nbd_client` fuzz corpus (fuzz/corpus/nbd_client): server
/// streams fed to the NBD client `ringblk backup` copies with, which must
/// answer or fail, never panic; the seeds reach the handshake, a block
/// status and a read (structured and simple replies).
#[test]
fn nbd_client_corpus_replays_cleanly() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/nbd_client");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    let mut seen = BTreeSet::new();
    for path in &files {
        let data = std::fs::read(path).unwrap();
        seen.extend(ringblk::nbd::fuzzing::client_one(&data));
        // Every prefix too: a server that stops anywhere.
        for cut in (0..data.len()).step_by(7) {
            ringblk::nbd::fuzzing::client_one(&data[..cut]);
        }
    }
    for want in ["handshake", "block-status", "read"] {
        assert!(
            seen.contains(want),
            "no corpus input reaches {want}; saw {seen:?}"
        );
    }
}
