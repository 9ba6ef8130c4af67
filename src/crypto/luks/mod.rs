//! LUKS1 and LUKS2 headers as `cryptsetup luksFormat` and `qemu-img
//! create -f luks` write them, and opening one with a passphrase: each
//! active keyslot's key is derived (PBKDF2 or Argon2), its area decrypted
//! (AES-XTS, plain64, 512-byte sectors), the anti-forensic stripes merged,
//! and the result checked against the header's digest. What comes out is
//! the volume key, in key memory, and the data segment: where the
//! ciphertext starts, its sector size, the key size and the IV tweak.
//!
//! Supported: cipher aes-xts-plain64 with a 256- or 512-bit key (AES-128
//! or AES-256 in XTS), for the data and for the keyslots; hashes sha1,
//! sha256 and sha512; LUKS2 keyslots of type luks2 with anti-forensic
//! type luks1 and a pbkdf2, argon2i or argon2id KDF; one data segment of
//! type crypt with 512- or 4096-byte sectors. Everything else is refused
//! with one line naming what is supported.
//!
//! The header comes from elsewhere (an image file), so every size it
//! names is bounded before it is used: the LUKS2 JSON area (4 MiB, as
//! cryptsetup allows) and its nesting, the keyslot count, area sizes and
//! stripes, key and salt sizes, and the KDF costs (`MAX_PBKDF2_ITERATIONS`,
//! `MAX_ARGON2_MEMORY_KIB`, `MAX_ARGON2_TIME`), checked before any
//! derivation runs.

mod kdf;
mod luks1;
mod luks2;

#[cfg(any(test, feature = "test-utils"))]
pub mod fuzzing;
#[cfg(test)]
mod tests;

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;

use crate::crypto::key::Secret;

pub use kdf::{Argon2Variant, Hash, Kdf};

/// The most PBKDF2 iterations a keyslot or digest may ask for (about 20
/// to 60 seconds of one core with SHA-256; cryptsetup's two-second
/// benchmark picks one to a few million).
pub const MAX_PBKDF2_ITERATIONS: u32 = 100_000_000;
/// The most memory an Argon2 keyslot may ask for: 4 GiB, cryptsetup's own
/// maximum (its default is at most 1 GiB).
pub const MAX_ARGON2_MEMORY_KIB: u32 = 4 * 1024 * 1024;
/// The most Argon2 passes a keyslot may ask for (cryptsetup's benchmark
/// picks 4 or a few more).
pub const MAX_ARGON2_TIME: u32 = 1000;
/// The most Argon2 lanes (cryptsetup uses at most 4).
pub const MAX_ARGON2_LANES: u32 = 16;
/// The most anti-forensic stripes (cryptsetup and QEMU write 4000).
pub const MAX_STRIPES: u32 = 4000;

/// Where a header is read from: an image file, a region of one (a qcow2
/// file's encryption header), or bytes in memory.
pub trait Source {
    /// The length of what holds the header, keyslots and data: keyslot
    /// areas must lie inside it and the data segment may not start past
    /// it.
    fn len(&self) -> u64;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Fills `buf` from `offset`; an error past `len`.
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()>;
}

impl Source for [u8] {
    fn len(&self) -> u64 {
        <[u8]>::len(self) as u64
    }

    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let start = usize::try_from(offset).unwrap_or(usize::MAX);
        match start
            .checked_add(buf.len())
            .and_then(|end| self.get(start..end))
        {
            Some(src) => {
                buf.copy_from_slice(src);
                Ok(())
            }
            None => Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "read past the end",
            )),
        }
    }
}

/// `len` bytes of a file from `base` (a whole image: base 0 and the
/// file's or device's size).
pub struct FileRegion<'a> {
    pub file: &'a File,
    pub base: u64,
    pub len: u64,
}

impl Source for FileRegion<'_> {
    fn len(&self) -> u64 {
        self.len
    }

    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let past = offset
            .checked_add(buf.len() as u64)
            .is_none_or(|end| end > self.len);
        if past {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "read past the end of the LUKS region",
            ));
        }
        self.file.read_exact_at(buf, self.base + offset)
    }
}

/// Why a header was refused or did not open. Each displays as one line.
#[derive(Debug, thiserror::Error)]
pub enum LuksError {
    #[error("reading the LUKS header: {0}")]
    Io(String),
    #[error("not a LUKS image: {0}")]
    NotLuks(String),
    #[error("damaged or hostile LUKS header: {0}")]
    Corrupt(String),
    #[error("unsupported LUKS image: {0}")]
    Unsupported(String),
    #[error("LUKS keyslot {slot} asks too much: {what}")]
    TooCostly { slot: u32, what: String },
    #[error("wrong passphrase: no keyslot opens with it (tried {tried})")]
    WrongPassphrase { tried: usize },
    #[error("LUKS keyslot {0}: {1}")]
    Keyslot(u32, String),
}

pub type Result<T> = std::result::Result<T, LuksError>;

pub(crate) fn corrupt(msg: impl Into<String>) -> LuksError {
    LuksError::Corrupt(msg.into())
}

pub(crate) fn unsupported(msg: impl Into<String>) -> LuksError {
    LuksError::Unsupported(msg.into())
}

/// What the supported cipher is called in refusals.
pub const SUPPORTED_CIPHER: &str = "aes-xts-plain64 with a 256- or 512-bit key";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Version {
    Luks1,
    Luks2,
}

/// The data segment: where the ciphertext is and how it is encrypted.
/// The cipher is always AES-XTS with the plain64 IV (the sector number,
/// little-endian, plus `iv_tweak`), the only one accepted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Segment {
    /// Byte offset of the first encrypted sector in the source.
    pub offset: u64,
    /// Its length in bytes; `None`: to the end of the device.
    pub size: Option<u64>,
    /// 512 or 4096.
    pub sector_size: u32,
    /// Added to the sector number (in 512-byte units) for the IV.
    pub iv_tweak: u64,
    /// The volume key's length: 32 (AES-128-XTS) or 64 (AES-256-XTS).
    pub key_bytes: usize,
}

/// A keyslot, bounded and checked.
#[derive(Clone, Debug)]
pub(crate) struct Keyslot {
    pub id: u32,
    /// LUKS2 priority: 2 is tried first; 0 ("ignore") never.
    pub priority: u8,
    pub kdf: Kdf,
    pub salt: Vec<u8>,
    pub area_offset: u64,
    pub area_size: u64,
    /// The key that encrypts the area (AES-XTS): 32 or 64 bytes.
    pub area_key_bytes: usize,
    pub stripes: u32,
    pub af_hash: Hash,
    /// Index into `Header::digests`.
    pub digest: usize,
}

/// A digest of the volume key (PBKDF2 over it), which a keyslot's result
/// must match.
#[derive(Clone, Debug)]
pub(crate) struct Digest {
    pub hash: Hash,
    pub iterations: u32,
    pub salt: Vec<u8>,
    pub digest: Vec<u8>,
}

/// A parsed, checked header: nothing it names exceeds the bounds above.
#[derive(Clone, Debug)]
pub struct Header {
    pub version: Version,
    pub uuid: String,
    pub segment: Segment,
    pub(crate) keyslots: Vec<Keyslot>,
    pub(crate) digests: Vec<Digest>,
}

/// An opened image: the volume key and where the data is.
#[derive(Debug)]
pub struct Unlocked {
    pub key: Secret,
    pub segment: Segment,
    /// The keyslot that opened.
    pub keyslot: u32,
}

/// Reads and checks the header at the start of `src` (LUKS1 or LUKS2).
pub fn read_header<S: Source + ?Sized>(src: &S) -> Result<Header> {
    let mut start = [0u8; 8];
    src.read_exact_at(&mut start, 0)
        .map_err(|e| LuksError::NotLuks(format!("too short for a LUKS header ({e})")))?;
    let version = u16::from_be_bytes([start[6], start[7]]);
    if &start[..6] == luks1::MAGIC && version == 1 {
        return luks1::parse(src);
    }
    if &start[..6] == luks1::MAGIC && version == 2 {
        return luks2::parse(src);
    }
    if &start[..6] == luks1::MAGIC {
        return Err(unsupported(format!(
            "LUKS version {version} (supported: 1 and 2)"
        )));
    }
    // A LUKS2 image whose primary header is damaged can still be opened
    // from its secondary copy.
    luks2::parse(src)
}

/// Reads the header and opens it with `passphrase`.
pub fn open<S: Source + ?Sized>(src: &S, passphrase: &[u8]) -> Result<Unlocked> {
    read_header(src)?.unlock(src, passphrase)
}

impl Header {
    /// The KDF of each keyslot that `unlock` would try, in that order.
    pub fn keyslot_kdfs(&self) -> Vec<(u32, Kdf)> {
        self.order().map(|k| (k.id, k.kdf.clone())).collect()
    }

    fn order(&self) -> impl Iterator<Item = &Keyslot> {
        let high = self.keyslots.iter().filter(|k| k.priority == 2);
        let normal = self.keyslots.iter().filter(|k| k.priority == 1);
        high.chain(normal)
    }

    /// Tries each active keyslot with `passphrase` (high priority first,
    /// those marked "ignore" never): the first whose result matches its
    /// digest gives the volume key.
    pub fn unlock<S: Source + ?Sized>(&self, src: &S, passphrase: &[u8]) -> Result<Unlocked> {
        let mut tried = 0;
        for slot in self.order() {
            tried += 1;
            if let Some(key) = self.try_keyslot(src, slot, passphrase)? {
                return Ok(Unlocked {
                    key,
                    segment: self.segment.clone(),
                    keyslot: slot.id,
                });
            }
        }
        if tried == 0 {
            return Err(unsupported("no active keyslot to open"));
        }
        Err(LuksError::WrongPassphrase { tried })
    }

    /// One keyslot: `Ok(None)` when the passphrase is not its own.
    fn try_keyslot<S: Source + ?Sized>(
        &self,
        src: &S,
        slot: &Keyslot,
        passphrase: &[u8],
    ) -> Result<Option<Secret>> {
        let key_bytes = self.segment.key_bytes;
        let mem = |e: io::Error| LuksError::Keyslot(slot.id, format!("key memory: {e}"));
        let mut area_key = Secret::zeroed(slot.area_key_bytes).map_err(mem)?;
        kdf::derive(&slot.kdf, passphrase, &slot.salt, area_key.as_mut_bytes())
            .map_err(|e| LuksError::Keyslot(slot.id, e))?;
        let split_len = key_bytes * slot.stripes as usize;
        let mut split = Secret::zeroed(split_len.div_ceil(512) * 512).map_err(mem)?;
        src.read_exact_at(split.as_mut_bytes(), slot.area_offset)
            .map_err(|e| LuksError::Io(format!("keyslot {} area: {e}", slot.id)))?;
        kdf::xts_decrypt_sectors(area_key.as_bytes(), split.as_mut_bytes())
            .map_err(|e| LuksError::Keyslot(slot.id, e))?;
        drop(area_key);
        let mut key = Secret::zeroed(key_bytes).map_err(mem)?;
        kdf::af_merge(
            slot.af_hash,
            &split.as_bytes()[..split_len],
            slot.stripes as usize,
            key.as_mut_bytes(),
        )
        .map_err(mem)?;
        drop(split);
        let d = &self.digests[slot.digest];
        let mut check = Secret::zeroed(d.digest.len()).map_err(mem)?;
        kdf::derive(
            &Kdf::Pbkdf2 {
                hash: d.hash,
                iterations: d.iterations,
            },
            key.as_bytes(),
            &d.salt,
            check.as_mut_bytes(),
        )
        .map_err(|e| LuksError::Keyslot(slot.id, e))?;
        Ok(crate::crypto::key::ct_eq(check.as_bytes(), &d.digest).then_some(key))
    }
}

/// Checks the KDF costs against the bounds, naming the keyslot.
pub(crate) fn check_kdf(slot: u32, kdf: &Kdf) -> Result<()> {
    let costly = |what: String| Err(LuksError::TooCostly { slot, what });
    match *kdf {
        Kdf::Pbkdf2 { iterations, .. } => {
            if iterations == 0 {
                return Err(corrupt(format!("keyslot {slot}: zero PBKDF2 iterations")));
            }
            if iterations > MAX_PBKDF2_ITERATIONS {
                return costly(format!(
                    "{iterations} PBKDF2 iterations (at most {MAX_PBKDF2_ITERATIONS})"
                ));
            }
        }
        Kdf::Argon2 {
            time,
            memory_kib,
            lanes,
            ..
        } => {
            if memory_kib > MAX_ARGON2_MEMORY_KIB {
                return costly(format!(
                    "Argon2 memory {memory_kib} KiB (at most {MAX_ARGON2_MEMORY_KIB} KiB, 4 GiB)"
                ));
            }
            if time > MAX_ARGON2_TIME {
                return costly(format!(
                    "Argon2 time cost {time} (at most {MAX_ARGON2_TIME})"
                ));
            }
            if lanes > MAX_ARGON2_LANES {
                return costly(format!("{lanes} Argon2 lanes (at most {MAX_ARGON2_LANES})"));
            }
            if time == 0 || lanes == 0 || memory_kib < 8 * lanes {
                return Err(corrupt(format!(
                    "keyslot {slot}: Argon2 time {time}, memory {memory_kib} KiB, {lanes} lanes \
                     (each must be at least 1, memory at least 8 KiB per lane)"
                )));
            }
        }
    }
    Ok(())
}

/// Checks a digest's bounds (the volume key's PBKDF2 check value).
pub(crate) fn check_digest(d: &Digest) -> Result<()> {
    if d.iterations == 0 || d.iterations > MAX_PBKDF2_ITERATIONS {
        return Err(corrupt(format!(
            "digest iterations {} (1 to {MAX_PBKDF2_ITERATIONS})",
            d.iterations
        )));
    }
    if d.digest.is_empty() || d.digest.len() > 64 || d.salt.is_empty() || d.salt.len() > 64 {
        return Err(corrupt(format!(
            "digest of {} bytes with a {}-byte salt (1 to 64 each)",
            d.digest.len(),
            d.salt.len()
        )));
    }
    Ok(())
}

/// Checks that the keyslot areas lie inside `[lo, hi)`, each big enough
/// for its stripes, none overlapping another, and that `hi` does not
/// pass the end of the source.
pub(crate) fn check_areas(
    keyslots: &[Keyslot],
    key_bytes: usize,
    lo: u64,
    hi: u64,
    src_len: u64,
) -> Result<()> {
    if hi > src_len {
        return Err(corrupt(format!(
            "the keyslot areas end at {hi}, past the end of the image ({src_len})"
        )));
    }
    let mut spans: Vec<(u64, u64, u32)> = Vec::with_capacity(keyslots.len());
    for k in keyslots {
        if !(1..=MAX_STRIPES).contains(&k.stripes) {
            return Err(corrupt(format!(
                "keyslot {}: {} anti-forensic stripes (1 to {MAX_STRIPES})",
                k.id, k.stripes
            )));
        }
        let need = (key_bytes as u64 * k.stripes as u64).div_ceil(512) * 512;
        let end = k.area_offset.checked_add(k.area_size);
        if k.area_size < need || k.area_offset % 512 != 0 {
            return Err(corrupt(format!(
                "keyslot {}: area of {} bytes at {} (needs {need} bytes, 512-byte aligned)",
                k.id, k.area_size, k.area_offset
            )));
        }
        match end {
            Some(end) if k.area_offset >= lo && end <= hi => spans.push((k.area_offset, end, k.id)),
            _ => {
                return Err(corrupt(format!(
                    "keyslot {}: area {}+{} outside the keyslots area {lo}..{hi}",
                    k.id, k.area_offset, k.area_size
                )));
            }
        }
    }
    spans.sort();
    for w in spans.windows(2) {
        if w[1].0 < w[0].1 {
            return Err(corrupt(format!(
                "keyslots {} and {} overlap",
                w[0].2, w[1].2
            )));
        }
    }
    Ok(())
}

/// The volume key size of aes-xts: 32 or 64 bytes.
pub(crate) fn check_key_bytes(what: &str, bytes: u64) -> Result<usize> {
    match bytes {
        32 | 64 => Ok(bytes as usize),
        _ => Err(unsupported(format!(
            "{what} key of {} bits (supported: {SUPPORTED_CIPHER})",
            bytes.saturating_mul(8)
        ))),
    }
}

/// Checks the segment against the source's length.
pub(crate) fn check_segment(seg: &Segment, metadata_end: u64, src_len: u64) -> Result<()> {
    if seg.offset < metadata_end {
        return Err(corrupt(format!(
            "data segment at {} overlaps the header and keyslots (which end at {metadata_end}; \
             a detached header is not supported)",
            seg.offset
        )));
    }
    if seg.offset > src_len {
        return Err(corrupt(format!(
            "data segment at {} starts past the end of the image ({src_len})",
            seg.offset
        )));
    }
    if let Some(size) = seg.size
        && seg.offset.checked_add(size).is_none_or(|end| end > src_len)
    {
        return Err(corrupt(format!(
            "data segment of {size} bytes at {} goes past the end of the image ({src_len})",
            seg.offset
        )));
    }
    if !seg.offset.is_multiple_of(seg.sector_size as u64) {
        return Err(corrupt(format!(
            "data segment at {} is not aligned to its {}-byte sectors",
            seg.offset, seg.sector_size
        )));
    }
    Ok(())
}
