//! A qcow2 layer encrypted with LUKS (`qemu-img create -o
//! encrypt.format=luks`, what libvirt and OpenStack make): crypt method 2
//! in the header, and the LUKS1 header and keyslots in clusters of the
//! file that the header extension 0x0537be77 names (offset and length).
//! Its data clusters hold AES-XTS ciphertext in 512-byte sectors whose
//! IV is the sector's *host* offset in the file (QEMU's
//! `crypt_physical_offset`), not the guest's: a cluster cannot be copied
//! from one place to another as bytes, only decrypted and encrypted
//! again (see `Qcow2Image::resolve`'s copy-on-write).
//!
//! Each layer of a chain has a header of its own; every encrypted layer
//! is opened with the one passphrase the daemon was given.

use std::fs::File;
use std::os::unix::fs::FileExt;

use super::bitmaps::{be32, be64};
use crate::crypto::key::Secret;
use crate::crypto::luks::{self, FileRegion};
use crate::disk::luks::Crypt;

/// The header extension that locates the LUKS header.
pub const EXT_CRYPT_HEADER: u32 = 0x0537_be77;

/// The LUKS header's region in a qcow2 file: (offset, length), read from
/// the header extensions in the first cluster of the file (`len` bytes
/// long). Each error is one line.
fn header_region(file: &File, len: u64) -> Result<(u64, u64), String> {
    let mut h = [0u8; 104];
    if len < h.len() as u64 {
        return Err("too short for a qcow2 version 3 header".into());
    }
    file.read_exact_at(&mut h, 0)
        .map_err(|e| format!("reading the header: {e}"))?;
    if be32(&h, 4) < 3 {
        return Err("an encrypted qcow2 of version 2 has no LUKS header".into());
    }
    let cluster_bits = be32(&h, 20);
    if !(9..=21).contains(&cluster_bits) {
        return Err(format!("cluster_bits {cluster_bits}"));
    }
    let area_len = (1u64 << cluster_bits).min(len);
    let header_len = u64::from(be32(&h, 100));
    if header_len < 104 || header_len >= area_len {
        return Err(format!("header length {header_len}"));
    }
    let mut area = vec![0u8; area_len as usize];
    file.read_exact_at(&mut area, 0)
        .map_err(|e| format!("reading the header extensions: {e}"))?;
    let mut at = header_len as usize;
    while at + 8 <= area.len() {
        let (kind, n) = (be32(&area, at), be32(&area, at + 4) as usize);
        if kind == 0 {
            break;
        }
        let data = at + 8;
        if n > area.len() - data {
            return Err(format!(
                "header extension {kind:#x} runs past the first cluster"
            ));
        }
        if kind == EXT_CRYPT_HEADER {
            if n != 16 {
                return Err(format!("crypt header extension of {n} bytes, not 16"));
            }
            let (offset, length) = (be64(&area, data), be64(&area, data + 8));
            if offset == 0 || length == 0 || offset.checked_add(length).is_none_or(|e| e > len) {
                return Err(format!(
                    "the LUKS header region ({length} bytes at {offset}) is not inside the {len}-byte file"
                ));
            }
            return Ok((offset, length));
        }
        at = data + n.next_multiple_of(8);
    }
    Err("crypt method LUKS, but no crypt header extension".into())
}

/// Opens the LUKS header of the encrypted qcow2 layer `file` with
/// `passphrase`: the layer's transform, its IVs counted from file byte 0.
/// Each error is one line (the caller names the file).
pub fn open(file: &File, passphrase: Option<&Secret>) -> Result<Crypt, String> {
    let Some(passphrase) = passphrase else {
        return Err(
            "is encrypted (encrypt.format=luks): give its passphrase with --key-file PATH or --key-fd N"
                .into(),
        );
    };
    let len = file.metadata().map_err(|e| e.to_string())?.len();
    let (base, length) = header_region(file, len)?;
    let region = FileRegion {
        file,
        base,
        len: length,
    };
    let header = luks::read_header(&region).map_err(|e| e.to_string())?;
    let unlocked = header
        .unlock(&region, passphrase.as_bytes())
        .map_err(|e| e.to_string())?;
    if unlocked.segment.sector_size != 512 || unlocked.segment.iv_tweak != 0 {
        return Err(format!(
            "the LUKS header has {}-byte sectors and IV tweak {}; QEMU's encrypted qcow2 has 512 and 0",
            unlocked.segment.sector_size, unlocked.segment.iv_tweak
        ));
    }
    Crypt::new(&unlocked.key, &unlocked.segment, 0)
}
