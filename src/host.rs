//! Facts of the running host that several leaves need: the bottom layer.

use std::fs;
use std::io;

/// Length of a boot id as the kernel prints it (a UUID, 36 characters).
pub const BOOT_ID_LEN: usize = 36;

/// The boot id of the running kernel, which changes at every boot: a file
/// written before a host stop and found again names another boot, so
/// what only the page cache held (written, never synced) may be gone.
pub fn boot_id() -> io::Result<[u8; BOOT_ID_LEN]> {
    let s = fs::read_to_string("/proc/sys/kernel/random/boot_id")?;
    s.trim()
        .as_bytes()
        .try_into()
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "unexpected boot_id format"))
}
