//! A qcow2 layer encrypted with LUKS (`qemu-img create -o
//! encrypt.format=luks`, what libvirt and OpenStack make): crypt method 2
//! in the header, and the LUKS1 header and keyslots in clusters of the
//! file that the header extension 0x0537be77 names (offset and length).
//! Its data clusters hold AES-XTS ciphertext in 512-byte sectors whose
//! IV is the sector's *host* offset in the file (QEMU's
//! `crypt_physical_offset`), not the guest's: a cluster cannot be copied
//! from one place to another as bytes, only decrypted and encrypted
//! again (`Qcow2Image::allocate_cow`, the copy-on-write).
//!
//! Each layer of a chain has a header of its own; every encrypted layer
//! is opened with the one passphrase the daemon was given. A live
//! snapshot's overlay of an encrypted top gets a copy of the top's header
//! ([`copy_header`]).

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

/// The most bytes a LUKS header region may have to be copied into an
/// overlay: QEMU's (a LUKS1 header and eight keyslot areas of 4000
/// stripes) is about 2 MiB.
const MAX_REGION: u64 = 16 << 20;

/// Makes the new qcow2 overlay `new` (as imago created it: the header,
/// one refcount table, one refcount block, the L1 table; nothing else
/// allocated, nothing pointing at it yet) an encrypted layer with the
/// LUKS header of the encrypted layer `old`: the header region is
/// copied into clusters appended to `new`, counted in its refcount
/// block, named by a crypt header extension, and the crypt method set.
/// The overlay so opens with the same passphrase and has the same volume
/// key as `old` (docs/encryption.md: a live snapshot of an encrypted
/// qcow2). An overlay this cannot extend (refcounts not 16 bits wide,
/// the region past what the first refcount block covers, no room for the
/// extension in the first cluster) is an error; nothing is made then.
pub fn copy_header(new: &File, old: &File) -> Result<(), String> {
    let old_len = old.metadata().map_err(|e| e.to_string())?.len();
    let (base, len) = header_region(old, old_len)?;
    if len > MAX_REGION {
        return Err(format!("a LUKS header region of {len} bytes"));
    }
    let mut region = vec![0u8; len as usize];
    old.read_exact_at(&mut region, base)
        .map_err(|e| format!("reading the LUKS header: {e}"))?;

    let mut h = [0u8; 104];
    new.read_exact_at(&mut h, 0)
        .map_err(|e| format!("reading the overlay's header: {e}"))?;
    let cluster_bits = be32(&h, 20);
    let cluster = 1u64 << cluster_bits;
    let header_len = u64::from(be32(&h, 100));
    let refcount_order = be32(&h, 96);
    let reftable = be64(&h, 48);
    let (backing_at, backing_len) = (be64(&h, 8), u64::from(be32(&h, 16)));
    if refcount_order != 4 {
        return Err(format!("refcounts of 2^{refcount_order} bits, not 16"));
    }
    let new_len = new.metadata().map_err(|e| e.to_string())?.len();
    let at = new_len.next_multiple_of(cluster);
    let (first, count) = (at >> cluster_bits, len.div_ceil(cluster));
    let per_block = cluster / 2;
    if first + count > per_block {
        return Err("the LUKS header would lie past the first refcount block".into());
    }
    let mut entry = [0u8; 8];
    new.read_exact_at(&mut entry, reftable)
        .map_err(|e| format!("reading the refcount table: {e}"))?;
    let refblock = u64::from_be_bytes(entry) & !((1u64 << 9) - 1);
    if refblock == 0 {
        return Err("no first refcount block".into());
    }

    // The extensions and the backing file name, rewritten with ours.
    let mut area = vec![0u8; cluster as usize];
    new.read_exact_at(&mut area[..cluster.min(new_len) as usize], 0)
        .map_err(|e| format!("reading the overlay's header: {e}"))?;
    let name_range = backing_at as usize..(backing_at + backing_len) as usize;
    let name = area
        .get(name_range)
        .ok_or("the backing file name is outside the first cluster")?
        .to_vec();
    let mut exts = Vec::new();
    let mut pos = header_len as usize;
    while pos + 8 <= area.len() {
        let (kind, n) = (be32(&area, pos), be32(&area, pos + 4) as usize);
        if kind == 0 {
            break;
        }
        if kind == EXT_CRYPT_HEADER || n > area.len() - pos - 8 {
            return Err("the overlay's header extensions are not as created".into());
        }
        exts.extend_from_slice(&area[pos..pos + 8 + n.next_multiple_of(8)]);
        pos += 8 + n.next_multiple_of(8);
    }
    exts.extend_from_slice(&EXT_CRYPT_HEADER.to_be_bytes());
    exts.extend_from_slice(&16u32.to_be_bytes());
    exts.extend_from_slice(&at.to_be_bytes());
    exts.extend_from_slice(&len.to_be_bytes());
    exts.extend_from_slice(&[0u8; 8]); // the end of the extensions
    let name_at = header_len as usize + exts.len();
    if name_at + name.len() > area.len() {
        return Err("no room for the crypt header extension in the first cluster".into());
    }

    let io = |what: &str, e: std::io::Error| format!("{what}: {e}");
    new.write_all_at(&region, at)
        .map_err(|e| io("writing the LUKS header", e))?;
    new.set_len(at + count * cluster)
        .map_err(|e| io("extending the overlay", e))?;
    for c in first..first + count {
        new.write_all_at(&1u16.to_be_bytes(), refblock + 2 * c)
            .map_err(|e| io("counting the LUKS header's clusters", e))?;
    }
    let mut tail = exts;
    tail.extend_from_slice(&name);
    new.write_all_at(&tail, header_len)
        .map_err(|e| io("writing the header extensions", e))?;
    let mut fields = Vec::new();
    fields.extend_from_slice(&(name_at as u64).to_be_bytes());
    new.write_all_at(&fields, 8)
        .map_err(|e| io("writing the header", e))?;
    new.write_all_at(&2u32.to_be_bytes(), 32)
        .map_err(|e| io("writing the header", e))?;
    new.sync_data().map_err(|e| io("fdatasync", e))
}
