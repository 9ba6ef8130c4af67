//! The keyslot's machinery: key derivation (PBKDF2-HMAC, Argon2), the
//! keyslot area's AES-XTS decryption (plain64, 512-byte sectors from 0)
//! and the anti-forensic merge (LUKS's AF with a hash's diffusion).
//!
//! The keyslot area is decrypted here, not through `crypto::xts` (the
//! data path's), so that this module stands alone; it is a few kilobytes
//! once per start-up.

use crate::crypto::key::Secret;

/// A hash LUKS names for PBKDF2, the AF diffusion and digests.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hash {
    Sha1,
    Sha256,
    Sha512,
}

impl Hash {
    pub fn parse(name: &str) -> Result<Hash, String> {
        match name {
            "sha1" => Ok(Hash::Sha1),
            "sha256" => Ok(Hash::Sha256),
            "sha512" => Ok(Hash::Sha512),
            _ => Err(format!(
                "hash {:?} (supported: sha1, sha256, sha512)",
                name.chars().take(32).collect::<String>()
            )),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Argon2Variant {
    Argon2i,
    Argon2id,
}

/// How a keyslot's key is derived from the passphrase.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Kdf {
    Pbkdf2 {
        hash: Hash,
        iterations: u32,
    },
    Argon2 {
        variant: Argon2Variant,
        time: u32,
        memory_kib: u32,
        lanes: u32,
    },
}

/// Derives `out.len()` bytes from `secret` and `salt`. The costs were
/// checked against the bounds when the header was parsed.
pub fn derive(kdf: &Kdf, secret: &[u8], salt: &[u8], out: &mut [u8]) -> Result<(), String> {
    match *kdf {
        Kdf::Pbkdf2 { hash, iterations } => {
            match hash {
                Hash::Sha1 => pbkdf2::pbkdf2_hmac::<sha1::Sha1>(secret, salt, iterations, out),
                Hash::Sha256 => pbkdf2::pbkdf2_hmac::<sha2::Sha256>(secret, salt, iterations, out),
                Hash::Sha512 => pbkdf2::pbkdf2_hmac::<sha2::Sha512>(secret, salt, iterations, out),
            }
            Ok(())
        }
        Kdf::Argon2 {
            variant,
            time,
            memory_kib,
            lanes,
        } => {
            let algorithm = match variant {
                Argon2Variant::Argon2i => argon2::Algorithm::Argon2i,
                Argon2Variant::Argon2id => argon2::Algorithm::Argon2id,
            };
            let params = argon2::Params::new(memory_kib, time, lanes, Some(out.len()))
                .map_err(|e| format!("Argon2 parameters: {e}"))?;
            argon2::Argon2::new(algorithm, argon2::Version::V0x13, params)
                .hash_password_into(secret, salt, out)
                .map_err(|e| format!("Argon2: {e}"))
        }
    }
}

/// Decrypts `data` in place with AES-XTS under `key` (32 bytes:
/// AES-128-XTS, 64: AES-256-XTS), 512-byte sectors numbered from 0
/// (plain64): a keyslot's area, through the same cipher as the data.
/// `data.len()` is a multiple of 512, and the key one of those sizes
/// (checked by the header's parser).
pub fn xts_decrypt_sectors(key: &[u8], data: &mut [u8]) -> Result<(), String> {
    use crate::crypto::xts::{IvUnit, SectorLayout, Xts};
    let layout = SectorLayout::new(512, IvUnit::Bytes512, 0).map_err(|e| e.to_string())?;
    Xts::new(key)
        .and_then(|x| x.decrypt(&layout, 0, data))
        .map_err(|e| format!("a keyslot's area: {e}"))
}

/// Merges `stripes` AF stripes of `out.len()` bytes each (`split`) into
/// `out`: d = 0; for each stripe but the last, d = H(d ^ stripe); then
/// out = d ^ last stripe.
pub fn af_merge(
    hash: Hash,
    split: &[u8],
    stripes: usize,
    out: &mut [u8],
) -> Result<(), std::io::Error> {
    let n = out.len();
    debug_assert_eq!(split.len(), n * stripes);
    let mut d = Secret::zeroed(n)?;
    for stripe in split.chunks_exact(n).take(stripes - 1) {
        for (x, s) in d.as_mut_bytes().iter_mut().zip(stripe) {
            *x ^= s;
        }
        match hash {
            Hash::Sha1 => diffuse::<sha1::Sha1>(d.as_mut_bytes()),
            Hash::Sha256 => diffuse::<sha2::Sha256>(d.as_mut_bytes()),
            Hash::Sha512 => diffuse::<sha2::Sha512>(d.as_mut_bytes()),
        }
    }
    let last = &split[(stripes - 1) * n..stripes * n];
    for ((o, x), s) in out.iter_mut().zip(d.as_bytes()).zip(last) {
        *o = x ^ s;
    }
    Ok(())
}

/// LUKS's diffusion: each digest-sized block i of `buf` becomes
/// H(be32(i) || block), truncated to the block's length.
fn diffuse<D: sha2::Digest>(buf: &mut [u8]) {
    let size = <D as sha2::Digest>::output_size();
    for (i, block) in buf.chunks_mut(size).enumerate() {
        let mut h = D::new();
        h.update((i as u32).to_be_bytes());
        h.update(&*block);
        let mut out = h.finalize();
        block.copy_from_slice(&out[..block.len()]);
        zeroize::Zeroize::zeroize(out.as_mut_slice());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pbkdf2_sha256_known_answer() {
        // RFC 7914 section 11: PBKDF2-HMAC-SHA256("passwd", "salt", 1, 64).
        let mut out = [0u8; 64];
        derive(
            &Kdf::Pbkdf2 {
                hash: Hash::Sha256,
                iterations: 1,
            },
            b"passwd",
            b"salt",
            &mut out,
        )
        .unwrap();
        assert_eq!(
            out[..16],
            [
                0x55, 0xac, 0x04, 0x6e, 0x56, 0xe3, 0x08, 0x9f, 0xec, 0x16, 0x91, 0xc2, 0x25, 0x44,
                0xb6, 0x05
            ]
        );
    }

    #[test]
    fn af_merge_of_one_stripe_is_the_stripe() {
        let mut out = [0u8; 32];
        af_merge(Hash::Sha256, &[7u8; 32], 1, &mut out).unwrap();
        assert_eq!(out, [7u8; 32]);
    }
}
