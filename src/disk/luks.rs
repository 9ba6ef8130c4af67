//! A LUKS1 or LUKS2 image on a raw file or block device (`--format
//! luks`), as `cryptsetup luksFormat` and `qemu-img create -f luks` make
//! it: the guest's disk is the header's data segment, and each of its
//! sectors is AES-XTS with the plain64 IV (see [`crate::crypto::xts`]).
//!
//! The disk decides *where* and *what*: guest byte `o` is file byte
//! `offset + o` ([`seam::ImageFormat::Luks`](super::seam::ImageFormat)),
//! and it is transformed with the queue's [`Crypt`]. The engine core
//! decides *how*: it decrypts a read in place in the guest's buffers
//! after the I/O and before the completion is published, and encrypts a
//! write (and a write-zeroes) into a private buffer the engine writes
//! from (`crate::engine::core`).
//!
//! The volume key is derived once, at start-up, before the sandbox
//! closes; the passphrase is zeroed as soon as it has been used, and the
//! expanded key lives in key memory ([`Locked`]).

use std::fs::File;
use std::mem::{align_of, size_of};
use std::ops::Deref;
use std::ptr::NonNull;

use crate::crypto::key::Secret;
use crate::crypto::luks::{self, FileRegion, Segment};
use crate::crypto::xts::{IvUnit, SectorLayout, Xts, XtsError};

/// How a file's bytes are encrypted: the expanded AES-XTS key and how
/// offsets in the file map to sectors and IVs. The IV of the sector at
/// file byte `o` is `(o - origin) / 512` plus the segment's `iv_tweak`,
/// for 512- and 4096-byte sectors alike: for a LUKS image the origin is
/// its data offset (dm-crypt counts sectors from the payload's start);
/// for a qcow2 layer it is 0 (QEMU's IV is the host offset in the
/// layer's file, `crypt_physical_offset`, so a cluster's ciphertext
/// depends on where it lies in its file). Every method takes file
/// offsets: where the engine does the I/O.
#[derive(Debug)]
pub struct Crypt {
    xts: Locked<Xts>,
    layout: SectorLayout,
    origin: u64,
}

impl Crypt {
    /// The transform of `segment` with the volume key `key`, its IVs
    /// counted from file byte `origin`.
    pub fn new(key: &Secret, segment: &Segment, origin: u64) -> Result<Crypt, String> {
        let layout = SectorLayout::new(
            segment.sector_size as usize,
            IvUnit::Bytes512,
            segment.iv_tweak,
        )
        .map_err(|e| e.to_string())?;
        let xts = Xts::new(key.as_bytes()).map_err(|e| e.to_string())?;
        let xts = Locked::new(xts).map_err(|e| format!("key memory: {e}"))?;
        Ok(Crypt {
            xts,
            layout,
            origin,
        })
    }

    /// The sector size: the guest's logical block size, and what every
    /// request's offset and length are multiples of.
    pub fn sector_size(&self) -> usize {
        self.layout.sector_size()
    }

    /// The offset the IVs count from for file byte `at`; an error before
    /// the origin (no sector of the file's data is there).
    #[inline]
    fn iv_offset(&self, at: u64) -> Result<u64, XtsError> {
        at.checked_sub(self.origin).ok_or(XtsError::Unaligned {
            offset: at,
            len: 0,
            sector_size: self.layout.sector_size(),
        })
    }

    /// Encrypts `buf` in place: whole sectors at file byte `at`.
    #[inline]
    pub fn encrypt(&self, at: u64, buf: &mut [u8]) -> Result<(), XtsError> {
        self.xts.encrypt(&self.layout, self.iv_offset(at)?, buf)
    }

    /// Decrypts `buf` in place: whole sectors at file byte `at`.
    #[inline]
    pub fn decrypt(&self, at: u64, buf: &mut [u8]) -> Result<(), XtsError> {
        self.xts.decrypt(&self.layout, self.iv_offset(at)?, buf)
    }

    /// Decrypts in place the bytes of `segments`, taken as one buffer at
    /// file byte `at` (a sector may straddle two of them).
    #[inline]
    pub fn decrypt_segments<S: std::ops::DerefMut<Target = [u8]>>(
        &self,
        at: u64,
        segments: &mut [S],
    ) -> Result<(), XtsError> {
        self.xts
            .decrypt_segments(&self.layout, self.iv_offset(at)?, segments)
    }
}

/// An opened LUKS image: its transform, and where its payload is.
#[derive(Debug)]
pub struct Luks {
    pub crypt: Crypt,
    /// Byte offset of guest byte 0 in the file.
    pub offset: u64,
    /// The payload's length; `None`: to the end of the file or device
    /// (LUKS2's "dynamic", LUKS1 always).
    pub size: Option<u64>,
    pub version: luks::Version,
    /// The keyslot that opened.
    pub keyslot: u32,
}

impl Luks {
    /// Reads the header of `file` (`len` bytes: the file's or device's
    /// size) and opens it with `passphrase`. Each error is one line.
    pub fn open(file: &File, len: u64, passphrase: &Secret) -> Result<Luks, String> {
        let src = FileRegion { file, base: 0, len };
        let header = luks::read_header(&src).map_err(|e| e.to_string())?;
        let unlocked = header
            .unlock(&src, passphrase.as_bytes())
            .map_err(|e| e.to_string())?;
        let crypt = Crypt::new(&unlocked.key, &unlocked.segment, unlocked.segment.offset)?;
        Ok(Luks {
            crypt,
            offset: unlocked.segment.offset,
            size: unlocked.segment.size,
            version: header.version,
            keyslot: unlocked.keyslot,
        })
    }

    /// The guest's size when the file or device is `len` bytes long.
    pub fn payload_size(&self, len: u64) -> u64 {
        self.size.unwrap_or_else(|| len.saturating_sub(self.offset))
    }
}

/// A value in key memory ([`Secret`]: locked into RAM where the limit
/// allows, left out of core dumps, zeroed when dropped): the expanded
/// AES key schedule, which is as secret as the key.
pub struct Locked<T> {
    ptr: NonNull<T>,
    /// The page-aligned mapping `ptr` points at.
    mem: Secret,
}

// SAFETY: `Locked<T>` owns its `T` exclusively (like a `Box<T>`), so it
// is Send and Sync where `T` is.
unsafe impl<T: Send> Send for Locked<T> {}
// SAFETY: as above; `&Locked<T>` gives out only `&T`.
unsafe impl<T: Sync> Sync for Locked<T> {}

impl<T> Locked<T> {
    /// Moves `value` into key memory. (The copy it is moved from, on the
    /// caller's stack, is not zeroed here; see [`Xts`]'s doc.)
    pub fn new(value: T) -> std::io::Result<Locked<T>> {
        const { assert!(align_of::<T>() <= 4096, "key memory is page-aligned") };
        let mut mem = Secret::zeroed(size_of::<T>())?;
        let ptr = NonNull::new(mem.as_mut_bytes().as_mut_ptr().cast::<T>())
            .expect("a mapping is never at address 0");
        // SAFETY: the mapping holds size_of::<T>() bytes (at least one
        // page), is page-aligned (so aligned for T, checked above), is
        // ours alone and lives as long as `mem`; nothing is there to drop.
        unsafe { ptr.as_ptr().write(value) };
        Ok(Locked { ptr, mem })
    }
}

impl<T> Deref for Locked<T> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: `new` wrote a T there, which lives until `drop`; `&self`
        // forbids a concurrent `&mut`.
        unsafe { self.ptr.as_ref() }
    }
}

impl<T> Drop for Locked<T> {
    fn drop(&mut self) {
        // SAFETY: the T written by `new`, dropped once; `mem`, dropped
        // after this, zeroes and unmaps the bytes.
        unsafe { std::ptr::drop_in_place(self.ptr.as_ptr()) };
    }
}

impl<T> std::fmt::Debug for Locked<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Locked({} bytes of key memory)", self.mem.len())
    }
}
