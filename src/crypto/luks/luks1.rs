//! LUKS1: the 592-byte big-endian header (cryptsetup's and QEMU's), eight
//! keyslots with PBKDF2, 4000 AF stripes, and the master key digest
//! (PBKDF2 over the key, 20 bytes).

use super::{
    Digest, Hash, Header, Kdf, Keyslot, Result, SUPPORTED_CIPHER, Segment, Source, Version,
    check_areas, check_digest, check_kdf, check_key_bytes, check_segment, corrupt, unsupported,
};

pub const MAGIC: &[u8; 6] = b"LUKS\xba\xbe";
const HEADER_LEN: usize = 592;
const SLOT_ACTIVE: u32 = 0x00AC_71F3;
const SLOT_INACTIVE: u32 = 0x0000_DEAD;

fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes(b[at..at + 4].try_into().unwrap())
}

/// A NUL-terminated name field, printable ASCII only.
fn name(b: &[u8], what: &str) -> Result<String> {
    let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
    let s = &b[..end];
    if s.iter().all(|c| c.is_ascii_graphic()) {
        Ok(String::from_utf8_lossy(s).into_owned())
    } else {
        Err(corrupt(format!("{what} is not a printable name")))
    }
}

pub fn parse<S: Source + ?Sized>(src: &S) -> Result<Header> {
    let mut h = [0u8; HEADER_LEN];
    src.read_exact_at(&mut h, 0)
        .map_err(|e| corrupt(format!("LUKS1 header truncated ({e})")))?;
    let cipher = name(&h[8..40], "cipher name")?;
    let mode = name(&h[40..72], "cipher mode")?;
    let hash_name = name(&h[72..104], "hash")?;
    if cipher != "aes" || mode != "xts-plain64" {
        return Err(unsupported(format!(
            "cipher {cipher}-{mode} (supported: {SUPPORTED_CIPHER})"
        )));
    }
    let hash = Hash::parse(&hash_name).map_err(unsupported)?;
    let payload_sectors = be32(&h, 104);
    let key_bytes = check_key_bytes("volume", be32(&h, 108) as u64)?;
    let digest = Digest {
        hash,
        iterations: be32(&h, 164),
        salt: h[132..164].to_vec(),
        digest: h[112..132].to_vec(),
    };
    check_digest(&digest)?;
    let uuid = name(&h[168..208], "UUID")?;

    let mut keyslots = Vec::new();
    for i in 0..8u32 {
        let s = &h[208 + 48 * i as usize..208 + 48 * (i as usize + 1)];
        match be32(s, 0) {
            SLOT_INACTIVE => continue,
            SLOT_ACTIVE => {}
            other => {
                return Err(corrupt(format!(
                    "keyslot {i}: state {other:#010x} is neither active nor inactive"
                )));
            }
        }
        let kdf = Kdf::Pbkdf2 {
            hash,
            iterations: be32(s, 4),
        };
        check_kdf(i, &kdf)?;
        let stripes = be32(s, 44);
        let area_offset = be32(s, 40) as u64 * 512;
        keyslots.push(Keyslot {
            id: i,
            priority: 1,
            kdf,
            salt: s[8..40].to_vec(),
            area_offset,
            // LUKS1 keeps no area size: the stripes' sectors.
            area_size: (key_bytes as u64 * stripes as u64).div_ceil(512) * 512,
            area_key_bytes: key_bytes,
            stripes,
            af_hash: hash,
            digest: 0,
        });
    }
    let payload = payload_sectors as u64 * 512;
    let segment = Segment {
        offset: payload,
        size: None,
        sector_size: 512,
        iv_tweak: 0,
        key_bytes,
    };
    check_segment(&segment, HEADER_LEN as u64, src.len())?;
    // The key material lies between the header and the payload.
    check_areas(&keyslots, key_bytes, HEADER_LEN as u64, payload, src.len())?;
    if keyslots.is_empty() {
        return Err(unsupported("no active keyslot"));
    }
    Ok(Header {
        version: Version::Luks1,
        uuid,
        segment,
        keyslots,
        digests: vec![digest],
    })
}
