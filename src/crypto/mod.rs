//! Encryption at rest (issue 30): what an encrypted image's bytes are
//! transformed with, and how its key is found. A leaf: it knows neither
//! the formats that carry it nor the engines that move the bytes.
//!
//! - [`luks`]: the LUKS1 and LUKS2 headers as cryptsetup and qemu-img
//!   write them, and opening a keyslot with a passphrase (PBKDF2,
//!   Argon2id), to the volume key;
//! - [`xts`]: AES-XTS over many sectors per call, with the plain64 IV
//!   dm-crypt and QEMU use;
//! - [`key`]: key material in locked memory, zeroed on drop, kept out of
//!   core dumps.

pub mod key;
pub mod luks;
pub mod xts;
