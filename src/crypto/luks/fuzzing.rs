//! The `luks` fuzz target's logic (fuzz/fuzz_targets/luks.rs), here so
//! that its corpus also replays under a plain `cargo test`
//! (tests/layers/fuzz_corpus.rs). The input is the start of an image,
//! read as if followed by zeros up to `VIRTUAL_LEN`: a seed need only
//! hold the headers, not the 16 MiB a LUKS2 image reserves. Each input is
//! parsed; when every cost it names is tiny, the passphrase "pass" is
//! tried too (key derivation, keyslot decryption, AF merge, digest).
//! Panics name the broken promise.

use std::io;

use super::{Kdf, LuksError, Source, read_header};

/// How long the zero-extended image is.
pub const VIRTUAL_LEN: u64 = 32 << 20;

/// The fuzz input followed by zeros.
pub struct ZeroExtended<'a>(pub &'a [u8]);

impl Source for ZeroExtended<'_> {
    fn len(&self) -> u64 {
        VIRTUAL_LEN.max(self.0.len() as u64)
    }

    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let end = offset
            .checked_add(buf.len() as u64)
            .filter(|&e| e <= self.len())
            .ok_or_else(|| io::Error::new(io::ErrorKind::UnexpectedEof, "past the end"))?;
        // No read is larger than a LUKS2 header copy or a keyslot area.
        assert!(
            buf.len() <= 4 << 20,
            "a read of {} bytes at {offset}",
            buf.len()
        );
        buf.fill(0);
        let data_len = self.0.len() as u64;
        if offset < data_len {
            let n = (end.min(data_len) - offset) as usize;
            buf[..n].copy_from_slice(&self.0[offset as usize..offset as usize + n]);
        }
        Ok(())
    }
}

#[derive(Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Refused at parse time, with the error's variant name.
    Refused(&'static str),
    /// Parsed; costs too high to try a passphrase here.
    Parsed,
    /// Parsed and a passphrase tried: opened or not (with why not).
    Tried(Result<(), &'static str>),
}

fn kind(e: &LuksError) -> &'static str {
    match e {
        LuksError::Io(_) => "Io",
        LuksError::NotLuks(_) => "NotLuks",
        LuksError::Corrupt(_) => "Corrupt",
        LuksError::Unsupported(_) => "Unsupported",
        LuksError::TooCostly { .. } => "TooCostly",
        LuksError::WrongPassphrase { .. } => "WrongPassphrase",
        LuksError::Keyslot(..) => "Keyslot",
    }
}

fn one_line(e: &LuksError) {
    let s = e.to_string();
    assert!(!s.contains('\n') && !s.is_empty(), "not one line: {s:?}");
}

pub fn run_one(data: &[u8]) -> Outcome {
    let src = ZeroExtended(data);
    let header = match read_header(&src) {
        Ok(h) => h,
        Err(e) => {
            one_line(&e);
            return Outcome::Refused(kind(&e));
        }
    };
    let seg = &header.segment;
    assert!(matches!(seg.key_bytes, 32 | 64), "{seg:?}");
    assert!(matches!(seg.sector_size, 512 | 4096), "{seg:?}");
    assert!(seg.offset <= src.len(), "{seg:?}");
    let mut tiny = true;
    for (slot, kdf) in header.keyslot_kdfs() {
        match kdf {
            Kdf::Pbkdf2 { iterations, .. } => {
                assert!((1..=super::MAX_PBKDF2_ITERATIONS).contains(&iterations));
                tiny &= iterations <= 4096;
            }
            Kdf::Argon2 {
                time,
                memory_kib,
                lanes,
                ..
            } => {
                assert!(memory_kib <= super::MAX_ARGON2_MEMORY_KIB, "slot {slot}");
                assert!(time <= super::MAX_ARGON2_TIME && lanes <= super::MAX_ARGON2_LANES);
                tiny &= time <= 8 && memory_kib <= 256;
            }
        }
    }
    tiny &= header.digests.iter().all(|d| d.iterations <= 4096);
    if !tiny {
        return Outcome::Parsed;
    }
    match header.unlock(&src, b"pass") {
        Ok(u) => {
            assert_eq!(u.key.len(), seg.key_bytes);
            Outcome::Tried(Ok(()))
        }
        Err(e) => {
            one_line(&e);
            Outcome::Tried(Err(kind(&e)))
        }
    }
}
