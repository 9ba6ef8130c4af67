//! AES-XTS (IEEE 1619) over whole sectors, with the `plain64` IV that
//! dm-crypt and QEMU use: the tweak of a sector is its IV as a
//! little-endian 64-bit integer, zero-padded to 16 bytes.
//!
//! The IV counts either 512-byte units or sectors ([`IvUnit`]). LUKS2
//! with 4096-byte sectors counts 512-byte units: cryptsetup does not set
//! dm-crypt's `iv_large_sectors` for LUKS2, so the sector at payload
//! offset `o` has IV `o / 512` (+ the segment's `iv_tweak`). LUKS1 and
//! QEMU's encrypted qcow2 have 512-byte sectors, where both rules agree.
//!
//! AES itself comes from RustCrypto's `aes`, which picks AES-NI, VAES-256
//! or VAES-512 at run time (no build flags: the binary runs on a CPU
//! without them). This module only chains the blocks: it hands the cipher
//! as many blocks at once as its backend pipelines (8 with AES-NI, 30 with
//! VAES-256, 64 with VAES-512), the tweaks XORed in around each batch. Measured against OpenSSL in
//! docs/benchmarks.md ("AES-XTS throughput").

use std::fmt;
use std::ops::DerefMut;

use aes::cipher::array::ArraySize;
use aes::cipher::consts::U16;
use aes::cipher::{
    Array, BlockCipherDecBackend, BlockCipherDecClosure, BlockCipherDecrypt, BlockCipherEncBackend,
    BlockCipherEncClosure, BlockCipherEncrypt, BlockSizeUser, KeyInit,
};
use aes::{Aes128, Aes256, Block};

/// The largest sector this module encrypts (LUKS2's largest is 4096).
pub const MAX_SECTOR: usize = 4096;
/// The AES block.
const BLOCK: usize = 16;
/// Sectors whose initial tweaks are computed in one batch.
const WINDOW: usize = 32;

/// What [`Xts`] refuses.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum XtsError {
    /// The key is neither two AES-128 keys nor two AES-256 keys.
    #[error("an AES-XTS key of {0} bytes: only 32 (AES-128) and 64 (AES-256) are supported")]
    KeyLength(usize),
    /// A sector size other than 512 or 4096.
    #[error("a sector size of {0} bytes: only 512 and 4096 are supported")]
    SectorSize(usize),
    /// A buffer that does not start on a sector or is not whole sectors.
    #[error("{len} bytes at offset {offset} are not whole {sector_size}-byte sectors")]
    Unaligned {
        /// The buffer's byte offset.
        offset: u64,
        /// Its length.
        len: usize,
        /// The layout's sector size.
        sector_size: usize,
    },
}

/// What one step of the IV counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IvUnit {
    /// 512-byte units, whatever the sector size (dm-crypt without
    /// `iv_large_sectors`: LUKS2 as cryptsetup sets it up, LUKS1, QEMU).
    Bytes512,
    /// Whole sectors (dm-crypt with `iv_large_sectors`).
    Sector,
}

/// How byte offsets map to sectors and IVs: the sector size, the unit of
/// the IV and a number added to every IV (LUKS2's `iv_tweak`, dm-crypt's
/// `iv_offset`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SectorLayout {
    sector_size: usize,
    /// log2 of the IV unit in bytes.
    unit_shift: u32,
    iv_offset: u64,
}

impl SectorLayout {
    /// A layout of `sector_size`-byte sectors (512 or 4096) whose IVs count
    /// `unit`s from `iv_offset` at offset 0.
    pub fn new(sector_size: usize, unit: IvUnit, iv_offset: u64) -> Result<Self, XtsError> {
        if sector_size != 512 && sector_size != MAX_SECTOR {
            return Err(XtsError::SectorSize(sector_size));
        }
        let unit_shift = match unit {
            IvUnit::Bytes512 => 9,
            IvUnit::Sector => sector_size.trailing_zeros(),
        };
        Ok(Self {
            sector_size,
            unit_shift,
            iv_offset,
        })
    }

    /// The sector size in bytes.
    pub fn sector_size(&self) -> usize {
        self.sector_size
    }

    /// The IV of the sector at byte `offset` (a multiple of the sector
    /// size). Wraps at 2^64, as dm-crypt's `plain64` does.
    pub fn iv_at(&self, offset: u64) -> u64 {
        (offset >> self.unit_shift).wrapping_add(self.iv_offset)
    }

    /// How much the IV grows from one sector to the next.
    fn iv_step(&self) -> u64 {
        (self.sector_size >> self.unit_shift) as u64
    }

    /// The first IV of `len` bytes at `offset`, if they are whole sectors.
    fn first_iv(&self, offset: u64, len: usize) -> Result<u64, XtsError> {
        let size = self.sector_size as u64;
        if !offset.is_multiple_of(size) || !len.is_multiple_of(self.sector_size) {
            return Err(XtsError::Unaligned {
                offset,
                len,
                sector_size: self.sector_size,
            });
        }
        Ok(self.iv_at(offset))
    }
}

/// The two keys of XTS: `data` encrypts the blocks, `tweak` the IVs.
/// (One per disk: boxing the larger variant would only add a move of its
/// round keys.)
#[allow(clippy::large_enum_variant)]
enum Keys {
    Aes128 { data: Aes128, tweak: Aes128 },
    Aes256 { data: Aes256, tweak: Aes256 },
}

/// An AES-XTS key, expanded. The `aes` crate zeroes its round keys on
/// drop, and the key bytes given to [`Xts::new`] are read in place, not
/// copied; but moving the ciphers into place may leave stale copies of
/// the round keys on the stack, and the AES calls spill round keys
/// there and leave them in vector registers; nothing here zeroes them:
/// the daemon overwrites its stacks and registers
/// ([`crate::crypto::key::scrub_stack`], [`crate::crypto::key::scrub_registers`])
/// after opening the image and before a queue thread sleeps.
pub struct Xts {
    keys: Keys,
}

impl fmt::Debug for Xts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Xts")
            .field("key_bits", &self.key_bits())
            .finish_non_exhaustive()
    }
}

impl Xts {
    /// An XTS key: 32 bytes (two AES-128 keys) or 64 (two AES-256 keys),
    /// the data key first, as LUKS stores it. Equal halves are accepted,
    /// as dm-crypt accepts them outside FIPS mode.
    pub fn new(key: &[u8]) -> Result<Self, XtsError> {
        let half = key.len() / 2;
        let (data, tweak) = key.split_at(half);
        let keys = match key.len() {
            32 => Keys::Aes128 {
                data: Aes128::new_from_slice(data).map_err(|_| XtsError::KeyLength(key.len()))?,
                tweak: Aes128::new_from_slice(tweak).map_err(|_| XtsError::KeyLength(key.len()))?,
            },
            64 => Keys::Aes256 {
                data: Aes256::new_from_slice(data).map_err(|_| XtsError::KeyLength(key.len()))?,
                tweak: Aes256::new_from_slice(tweak).map_err(|_| XtsError::KeyLength(key.len()))?,
            },
            n => return Err(XtsError::KeyLength(n)),
        };
        Ok(Self { keys })
    }

    /// 256 for AES-128-XTS, 512 for AES-256-XTS (the XTS key's size).
    pub fn key_bits(&self) -> usize {
        match self.keys {
            Keys::Aes128 { .. } => 256,
            Keys::Aes256 { .. } => 512,
        }
    }

    /// Encrypts `buf` in place: whole sectors of `layout` at byte `offset`.
    pub fn encrypt(
        &self,
        layout: &SectorLayout,
        offset: u64,
        buf: &mut [u8],
    ) -> Result<(), XtsError> {
        let iv = layout.first_iv(offset, buf.len())?;
        self.crypt(Dir::Encrypt, layout.sector_size, layout.iv_step(), iv, buf);
        Ok(())
    }

    /// Decrypts `buf` in place: whole sectors of `layout` at byte `offset`.
    pub fn decrypt(
        &self,
        layout: &SectorLayout,
        offset: u64,
        buf: &mut [u8],
    ) -> Result<(), XtsError> {
        let iv = layout.first_iv(offset, buf.len())?;
        self.crypt(Dir::Decrypt, layout.sector_size, layout.iv_step(), iv, buf);
        Ok(())
    }

    /// Encrypts in place the bytes of `segments` taken as one buffer at
    /// byte `offset` (an iovec: guest buffers need not split on sectors).
    /// Their total must be whole sectors.
    pub fn encrypt_segments<S: DerefMut<Target = [u8]>>(
        &self,
        layout: &SectorLayout,
        offset: u64,
        segments: &mut [S],
    ) -> Result<(), XtsError> {
        self.crypt_segments(Dir::Encrypt, layout, offset, segments)
    }

    /// Decrypts in place the bytes of `segments` taken as one buffer at
    /// byte `offset`, as [`Xts::encrypt_segments`] encrypts them.
    pub fn decrypt_segments<S: DerefMut<Target = [u8]>>(
        &self,
        layout: &SectorLayout,
        offset: u64,
        segments: &mut [S],
    ) -> Result<(), XtsError> {
        self.crypt_segments(Dir::Decrypt, layout, offset, segments)
    }

    fn crypt_segments<S: DerefMut<Target = [u8]>>(
        &self,
        dir: Dir,
        layout: &SectorLayout,
        offset: u64,
        segments: &mut [S],
    ) -> Result<(), XtsError> {
        let len = segments
            .iter()
            .fold(0usize, |n, s| n.saturating_add(s.len()));
        let mut iv = layout.first_iv(offset, len)?;
        let (size, step) = (layout.sector_size, layout.iv_step());
        // A sector split between segments is gathered here, transformed
        // and scattered back; whole sectors are transformed where they lie.
        let mut scratch = [0u8; MAX_SECTOR];
        let (mut seg, mut pos) = (0, 0);
        while seg < segments.len() {
            let here = &mut segments[seg][pos..];
            if here.is_empty() {
                (seg, pos) = (seg + 1, 0);
            } else if here.len() >= size {
                let whole = here.len() / size * size;
                self.crypt(dir, size, step, iv, &mut here[..whole]);
                iv = iv.wrapping_add((whole / size) as u64 * step);
                pos += whole;
            } else {
                let sector = &mut scratch[..size];
                copy_span(segments, seg, pos, sector, Transfer::Gather);
                self.crypt(dir, size, step, iv, sector);
                (seg, pos) = copy_span(segments, seg, pos, sector, Transfer::Scatter);
                iv = iv.wrapping_add(step);
            }
        }
        Ok(())
    }

    /// Transforms `buf`, whole data units of `unit` bytes (a multiple of
    /// 16), the first with IV `iv`, each next one `step` more.
    fn crypt(&self, dir: Dir, unit: usize, step: u64, iv: u64, buf: &mut [u8]) {
        match &self.keys {
            Keys::Aes128 { data, tweak } => crypt_with(data, tweak, dir, unit, step, iv, buf),
            Keys::Aes256 { data, tweak } => crypt_with(data, tweak, dir, unit, step, iv, buf),
        }
    }
}

#[derive(Clone, Copy)]
enum Dir {
    Encrypt,
    Decrypt,
}

#[derive(Clone, Copy)]
enum Transfer {
    Gather,
    Scatter,
}

/// Copies `sector.len()` bytes between `sector` and the segments from
/// `segments[seg][pos..]` on; returns where they end. The caller has
/// checked that the segments hold that many bytes.
fn copy_span<S: DerefMut<Target = [u8]>>(
    segments: &mut [S],
    mut seg: usize,
    mut pos: usize,
    sector: &mut [u8],
    how: Transfer,
) -> (usize, usize) {
    let mut done = 0;
    while done < sector.len() {
        let here = &mut segments[seg][pos..];
        let n = here.len().min(sector.len() - done);
        match how {
            Transfer::Gather => sector[done..done + n].copy_from_slice(&here[..n]),
            Transfer::Scatter => here[..n].copy_from_slice(&sector[done..done + n]),
        }
        done += n;
        pos += n;
        if pos == segments[seg].len() {
            (seg, pos) = (seg + 1, 0);
        }
    }
    (seg, pos)
}

/// [`Xts::crypt`] with one AES variant: the tweaks of up to [`WINDOW`]
/// sectors are encrypted in one batch, then their data in one pass
/// through the cipher's backend.
fn crypt_with<C>(data: &C, tweak: &C, dir: Dir, size: usize, step: u64, iv: u64, buf: &mut [u8])
where
    C: BlockCipherEncrypt + BlockCipherDecrypt + BlockSizeUser<BlockSize = U16>,
{
    debug_assert!(size.is_multiple_of(BLOCK) && buf.len().is_multiple_of(size));
    let mut tweaks = [Block::default(); WINDOW];
    let mut iv = iv;
    for window in buf.chunks_mut(WINDOW * size) {
        let n = window.len() / size;
        for t in &mut tweaks[..n] {
            *t = Array::from((iv as u128).to_le_bytes());
            iv = iv.wrapping_add(step);
        }
        tweak.encrypt_blocks(&mut tweaks[..n]);
        let pass = Pass {
            buf: window,
            tweaks: &tweaks[..n],
            blocks_per_sector: size / BLOCK,
        };
        match dir {
            Dir::Encrypt => data.encrypt_with_backend(pass),
            Dir::Decrypt => data.decrypt_with_backend(pass),
        }
    }
}

/// One pass of XTS over whole sectors whose encrypted tweaks are known,
/// run inside the cipher's backend (so in its target-feature context).
struct Pass<'a> {
    buf: &'a mut [u8],
    tweaks: &'a [Block],
    blocks_per_sector: usize,
}

impl BlockSizeUser for Pass<'_> {
    type BlockSize = U16;
}

impl BlockCipherEncClosure for Pass<'_> {
    #[inline(always)]
    fn call<B: BlockCipherEncBackend<BlockSize = U16>>(self, backend: &B) {
        self.run::<B::ParBlocksSize>(|blocks| backend.encrypt_par_blocks_inplace(blocks));
    }
}

impl BlockCipherDecClosure for Pass<'_> {
    #[inline(always)]
    fn call<B: BlockCipherDecBackend<BlockSize = U16>>(self, backend: &B) {
        self.run::<B::ParBlocksSize>(|blocks| backend.decrypt_par_blocks_inplace(blocks));
    }
}

impl Pass<'_> {
    /// Runs XTS over the sectors in spans of whole sectors, at least `P`
    /// blocks where a sector is shorter: each span's tweaks are computed
    /// first and XORed into the data, `cipher` runs over `P` blocks at a
    /// time, and the tweaks are XORed again. A last batch of fewer than
    /// `P` blocks is padded with stale blocks whose output is dropped: one
    /// pipelined call costs less than single blocks.
    #[inline(always)]
    fn run<P: ArraySize>(self, cipher: impl Fn(&mut Array<Block, P>)) {
        let bps = self.blocks_per_sector;
        debug_assert!((1..=SPAN).contains(&bps));
        let per_span = (P::USIZE / bps).clamp(1, SPAN / bps);
        let mut tw = [[0u64; 2]; SPAN];
        let mut batch: Array<Block, P> = Array::default();
        for (span, tweaks) in self
            .buf
            .chunks_mut(per_span * bps * BLOCK)
            .zip(self.tweaks.chunks(per_span))
        {
            let tw = &mut tw[..span.len() / BLOCK];
            for (tw, t) in tw.chunks_exact_mut(bps).zip(tweaks) {
                sector_tweaks(tw, u128::from_le_bytes(t.0));
            }
            xor_tweaks(span, tw);
            let (blocks, _) = Block::slice_as_chunks_mut(span);
            let mut groups = blocks.chunks_exact_mut(P::USIZE);
            for group in &mut groups {
                let group: &mut Array<Block, P> = group.try_into().expect("P blocks");
                cipher(group);
            }
            let rest = groups.into_remainder();
            if !rest.is_empty() {
                batch[..rest.len()].copy_from_slice(rest);
                cipher(&mut batch);
                rest.copy_from_slice(&batch[..rest.len()]);
            }
            xor_tweaks(span, tw);
        }
    }
}

/// The most blocks whose tweaks [`Pass::run`] holds at once: a 4096-byte
/// sector's.
const SPAN: usize = MAX_SECTOR / BLOCK;

/// The tweaks of a sector's blocks, as many as `tw` holds, as (low,
/// high) 64-bit halves, from its encrypted IV `t`: block j's is t·x^j.
/// The first 8 one by one, then each from the one 8 before: 8
/// independent chains instead of one.
#[inline(always)]
fn sector_tweaks(tw: &mut [[u64; 2]], t: u128) {
    let mut t = t;
    let head = tw.len().min(8);
    for w in &mut tw[..head] {
        *w = [t as u64, (t >> 64) as u64];
        t = mul_x_n(t, 1);
    }
    for k in 8..tw.len() {
        let [lo, hi] = tw[k - 8];
        // t·x^8: the top byte shifted out comes back times x^7+x^2+x+1.
        let c = hi >> 56;
        tw[k] = [
            (lo << 8) ^ c ^ (c << 1) ^ (c << 2) ^ (c << 7),
            (hi << 8) | (lo >> 56),
        ];
    }
}

/// XORs each block of `buf` with its tweak.
#[inline(always)]
fn xor_tweaks(buf: &mut [u8], tw: &[[u64; 2]]) {
    for (b, t) in buf.chunks_exact_mut(BLOCK).zip(tw) {
        let (lo, hi) = b.split_at_mut(8);
        let lo: &mut [u8; 8] = lo.try_into().expect("8 bytes");
        let hi: &mut [u8; 8] = hi.try_into().expect("8 bytes");
        *lo = (u64::from_le_bytes(*lo) ^ t[0]).to_le_bytes();
        *hi = (u64::from_le_bytes(*hi) ^ t[1]).to_le_bytes();
    }
}

/// Multiplication by x^n (1 <= n <= 121) in GF(2^128) with IEEE 1619's
/// little-endian bit order: the tweak n blocks on. The n bits shifted out
/// come back multiplied by x^7 + x^2 + x + 1.
#[inline(always)]
fn mul_x_n(t: u128, n: u32) -> u128 {
    debug_assert!((1..=121).contains(&n));
    let c = t >> (128 - n);
    (t << n) ^ c ^ (c << 1) ^ (c << 2) ^ (c << 7)
}

#[cfg(test)]
mod tests;
