//! Key material (a volume key, a passphrase, a keyslot's derived key) in
//! memory of its own: a private anonymous mapping, page-aligned, locked
//! into RAM where `RLIMIT_MEMLOCK` allows (a warning, once, where it does
//! not), left out of core dumps (`MADV_DONTDUMP`), and zeroed before it is
//! unmapped. `Debug` prints its length, never its bytes.
//!
//! A key is read from a file or an inherited descriptor, never from the
//! command line or the environment, which other processes can read
//! (`/proc/PID/cmdline`, `/proc/PID/environ`).

use std::fmt;
use std::fs::File;
use std::io::{self, Read};
use std::os::fd::{AsRawFd, BorrowedFd};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::Path;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering};

use zeroize::Zeroize;

/// The most bytes a key file or descriptor may hold: a passphrase or a
/// raw key is far smaller (cryptsetup's own limit for a key file is 8 MiB,
/// but its passphrases stop at 512 bytes by default).
pub const MAX_KEY_FILE: usize = 64 * 1024;

static MLOCK_WARNED: AtomicBool = AtomicBool::new(false);

/// Overwrites the `N` bytes of the calling thread's stack below the
/// caller's frame with zeroes, where the functions the caller called before left
/// what they held: the AES key schedules are built by value, on the
/// stack, before they are moved into key memory, and the key derivation's
/// frames held the volume key. Call it from a frame no deeper than the
/// one that called those functions, once they returned. At start-up
/// (the key derivation) 64 KiB; a queue thread, where the AES calls spill
/// round keys, before it sleeps: [`PASS_STACK_SCRUB`].
#[inline(never)]
pub fn scrub_stack<const N: usize>() {
    let mut below = [0u8; N];
    // Volatile writes: not optimised away although nothing reads them.
    below.zeroize();
    std::hint::black_box(&below);
}

/// How much of its stack a thread zeroes once an AES pass returned: as
/// deep as the AES calls' frames reach below the caller's, with room to
/// spare (round keys were found about 27 KiB below a queue worker's pass
/// in a debug build, whose frames spill every register, and 15 KiB in a
/// release one).
pub const PASS_STACK_SCRUB: usize = if cfg!(debug_assertions) {
    48 * 1024
} else {
    24 * 1024
};

/// What an AES pass left on this thread, overwritten: [`PASS_STACK_SCRUB`]
/// bytes of stack below the caller's frame, and the vector registers.
/// For a thread that encrypts or decrypts off the data path (a qcow2
/// image's copy-on-write on its metadata thread, a backup's reads on the
/// NBD thread), right after the pass returns, so that a core dump taken
/// while it waits holds no round key. A queue thread does it before it
/// sleeps instead.
#[inline(always)]
pub fn scrub_after_pass() {
    scrub_stack::<PASS_STACK_SCRUB>();
    scrub_registers();
}

/// Zeroes the vector registers the AES calls leave round keys in: a
/// sleeping thread's registers are saved by the kernel and written into a
/// core dump. `vzeroall` clears ymm0-15 (and zmm0-15's upper halves); with
/// AVX-512 (the VAES backend's zmm registers) zmm16-31 are cleared too.
/// Without AVX the AES-NI code's xmm0-15 are not cleared.
pub fn scrub_registers() {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx")]
        fn zeroall() {
            std::arch::x86_64::_mm256_zeroall();
        }
        #[target_feature(enable = "avx512f")]
        fn zero_high_zmm() {
            // SAFETY: only writes zmm16-31, declared clobbered; no memory,
            // no stack, no flags.
            unsafe {
                std::arch::asm!(
                    "vpxord zmm16, zmm16, zmm16", "vpxord zmm17, zmm17, zmm17",
                    "vpxord zmm18, zmm18, zmm18", "vpxord zmm19, zmm19, zmm19",
                    "vpxord zmm20, zmm20, zmm20", "vpxord zmm21, zmm21, zmm21",
                    "vpxord zmm22, zmm22, zmm22", "vpxord zmm23, zmm23, zmm23",
                    "vpxord zmm24, zmm24, zmm24", "vpxord zmm25, zmm25, zmm25",
                    "vpxord zmm26, zmm26, zmm26", "vpxord zmm27, zmm27, zmm27",
                    "vpxord zmm28, zmm28, zmm28", "vpxord zmm29, zmm29, zmm29",
                    "vpxord zmm30, zmm30, zmm30", "vpxord zmm31, zmm31, zmm31",
                    out("zmm16") _, out("zmm17") _, out("zmm18") _, out("zmm19") _,
                    out("zmm20") _, out("zmm21") _, out("zmm22") _, out("zmm23") _,
                    out("zmm24") _, out("zmm25") _, out("zmm26") _, out("zmm27") _,
                    out("zmm28") _, out("zmm29") _, out("zmm30") _, out("zmm31") _,
                    options(nomem, nostack, preserves_flags),
                );
            }
        }
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F (checked just above), all
            // `zero_high_zmm`'s target feature asks for.
            unsafe { zero_high_zmm() };
        }
        if std::arch::is_x86_feature_detected!("avx") {
            // SAFETY: the CPU has AVX (checked just above), all
            // `zeroall`'s target feature asks for.
            unsafe { zeroall() };
        }
    }
}

/// Bytes of key material in their own locked, undumpable pages.
pub struct Secret {
    ptr: NonNull<u8>,
    len: usize,
    /// The mapping's length: `len` rounded up to whole pages (at least one).
    map_len: usize,
    locked: bool,
}

// SAFETY: `Secret` owns its mapping exclusively (like a `Box<[u8]>`); no
// other handle to it exists, so moving it to another thread or sharing `&`
// references across threads is as safe as for a `Vec<u8>`.
unsafe impl Send for Secret {}
// SAFETY: as above; `&Secret` only gives out `&[u8]`.
unsafe impl Sync for Secret {}

impl Secret {
    /// `len` zero bytes of key material.
    pub fn zeroed(len: usize) -> io::Result<Secret> {
        // SAFETY: sysconf has no memory-safety preconditions.
        let page = match unsafe { libc::sysconf(libc::_SC_PAGESIZE) } {
            p if p > 0 => p as usize,
            _ => 4096,
        };
        let map_len = len.max(1).div_ceil(page) * page;
        // SAFETY: a fresh private anonymous mapping: no address hint, no
        // file; the kernel picks where it goes and it aliases nothing.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if addr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: addr/map_len is the mapping made above, ours alone.
        // MADV_DONTDUMP only changes what a core dump includes.
        if unsafe { libc::madvise(addr, map_len, libc::MADV_DONTDUMP) } != 0 {
            let e = io::Error::last_os_error();
            // SAFETY: unmapping the mapping made above, not yet shared.
            unsafe { libc::munmap(addr, map_len) };
            return Err(io::Error::new(
                e.kind(),
                format!("madvise(MADV_DONTDUMP) on key memory: {e}"),
            ));
        }
        // SAFETY: mlock on our own mapping; it fails cleanly (EPERM,
        // ENOMEM) when RLIMIT_MEMLOCK is too small.
        let locked = unsafe { libc::mlock(addr, map_len) } == 0;
        if !locked && !MLOCK_WARNED.swap(true, Ordering::Relaxed) {
            log::warn!(
                "cannot lock key memory into RAM ({}); key material may be swapped out \
                 (raise RLIMIT_MEMLOCK, e.g. LimitMEMLOCK= in the unit)",
                io::Error::last_os_error()
            );
        }
        Ok(Secret {
            // SAFETY: mmap succeeded, so addr is not null.
            ptr: unsafe { NonNull::new_unchecked(addr.cast()) },
            len,
            map_len,
            locked,
        })
    }

    /// A copy of `bytes` in key memory. (The caller wipes its own copy.)
    pub fn from_slice(bytes: &[u8]) -> io::Result<Secret> {
        let mut s = Secret::zeroed(bytes.len())?;
        s.as_mut_bytes().copy_from_slice(bytes);
        Ok(s)
    }

    pub fn as_bytes(&self) -> &[u8] {
        // SAFETY: ptr..ptr+len lies inside our mapping (len <= map_len),
        // which lives as long as self; `&self` forbids a concurrent `&mut`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    pub fn as_mut_bytes(&mut self) -> &mut [u8] {
        // SAFETY: as in as_bytes, and `&mut self` makes this the only view.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether the pages are locked into RAM (false where mlock failed).
    pub fn is_locked(&self) -> bool {
        self.locked
    }

    /// Shortens the secret to `len` bytes, zeroing the bytes cut off.
    pub fn truncate(&mut self, len: usize) {
        if len < self.len {
            // SAFETY: [len, self.len) lies inside the mapping.
            let tail = unsafe {
                std::slice::from_raw_parts_mut(self.ptr.as_ptr().add(len), self.len - len)
            };
            tail.zeroize();
            self.len = len;
        }
    }
}

impl Drop for Secret {
    fn drop(&mut self) {
        // SAFETY: the whole mapping is ours; zeroize writes it with
        // volatile stores the optimiser may not drop.
        let all = unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.map_len) };
        all.zeroize();
        // SAFETY: unmapping our own mapping, made by `zeroed` with this
        // length; no reference into it outlives self. munmap also drops
        // the lock, so no munlock is needed.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.map_len) };
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Secret({} bytes, redacted)", self.len)
    }
}

impl PartialEq for Secret {
    /// Constant-time in the contents (length is not secret).
    fn eq(&self, other: &Secret) -> bool {
        ct_eq(self.as_bytes(), other.as_bytes())
    }
}

/// Equality of two byte strings without an early exit on the first
/// difference.
pub fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Key material read from a file or descriptor, and a warning for the
/// caller to log when the file is readable by group or others.
#[derive(Debug)]
pub struct KeyRead {
    pub secret: Secret,
    pub warning: Option<String>,
}

/// Reads a passphrase or key from the file at `path`: all of its bytes, a
/// trailing newline included (as `cryptsetup --key-file` and QEMU's
/// `secret,file=` do), at most `cap` bytes. The path may be a symlink
/// (systemd credentials and secret stores use them); what it names must
/// be a regular file, opened without blocking (a FIFO is refused).
pub fn read_key_file(path: &Path, cap: usize) -> Result<KeyRead, String> {
    let file = File::options()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| format!("key file {}: {e}", path.display()))?;
    let meta = file
        .metadata()
        .map_err(|e| format!("key file {}: {e}", path.display()))?;
    if !meta.file_type().is_file() {
        return Err(format!("key file {}: not a regular file", path.display()));
    }
    let warning = loose_mode(meta.mode()).map(|m| {
        format!(
            "key file {} is readable by group or others (mode {m:04o}); make it 0600 or 0400",
            path.display()
        )
    });
    let secret =
        read_bounded(&file, cap).map_err(|e| format!("key file {}: {e}", path.display()))?;
    Ok(KeyRead { secret, warning })
}

/// Reads a passphrase or key from an inherited descriptor (a pipe, a
/// socket or a file) to its end, at most `cap` bytes. A regular file
/// behind it gets the same mode check as `read_key_file`.
pub fn read_key_fd(fd: BorrowedFd<'_>, cap: usize) -> Result<KeyRead, String> {
    let raw = fd.as_raw_fd();
    let file = File::from(
        fd.try_clone_to_owned()
            .map_err(|e| format!("key descriptor {raw}: {e}"))?,
    );
    let meta = file
        .metadata()
        .map_err(|e| format!("key descriptor {raw}: {e}"))?;
    let warning = if meta.file_type().is_file() {
        loose_mode(meta.mode()).map(|m| {
            format!(
                "key descriptor {raw} is a file readable by group or others (mode {m:04o}); make it 0600 or 0400"
            )
        })
    } else {
        None
    };
    let secret = read_bounded(&file, cap).map_err(|e| format!("key descriptor {raw}: {e}"))?;
    Ok(KeyRead { secret, warning })
}

fn loose_mode(mode: u32) -> Option<u32> {
    (mode & 0o044 != 0).then_some(mode & 0o7777)
}

/// Reads to the end, into key memory, refusing more than `cap` bytes.
fn read_bounded(mut f: &File, cap: usize) -> Result<Secret, String> {
    // One byte more than the cap tells a file that is too large.
    let mut s = Secret::zeroed(cap + 1).map_err(|e| e.to_string())?;
    let mut got = 0;
    loop {
        match f.read(&mut s.as_mut_bytes()[got..]) {
            Ok(0) => break,
            Ok(n) => {
                got += n;
                if got > cap {
                    return Err(format!("larger than {cap} bytes"));
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                return Err("would block (a FIFO or socket with no writer?)".into());
            }
            Err(e) => return Err(e.to_string()),
        }
    }
    if got == 0 {
        return Err("empty".into());
    }
    s.truncate(got);
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn secret_is_zeroed_locked_or_not_and_redacted() {
        let s = Secret::from_slice(b"hunter2").unwrap();
        assert_eq!(s.as_bytes(), b"hunter2");
        let dbg = format!("{s:?}");
        assert!(!dbg.contains("hunter2"), "{dbg}");
        assert!(dbg.contains("7 bytes"), "{dbg}");
        // The mapping is excluded from core dumps: /proc/self/smaps shows
        // the `dd` flag on it.
        let addr = s.as_bytes().as_ptr() as usize;
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let mut in_ours = false;
        let mut flags = None;
        for line in smaps.lines() {
            if let Some((range, _)) = line.split_once(' ')
                && let Some((a, b)) = range.split_once('-')
                && let (Ok(a), Ok(b)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16))
            {
                in_ours = a <= addr && addr < b;
            } else if in_ours && let Some(f) = line.strip_prefix("VmFlags:") {
                flags = Some(f.to_string());
            }
        }
        let flags = flags.expect("our mapping in smaps");
        assert!(flags.split_whitespace().any(|f| f == "dd"), "{flags}");
        if s.is_locked() {
            assert!(flags.split_whitespace().any(|f| f == "lo"), "{flags}");
        }
    }

    #[test]
    fn truncate_zeroes_the_tail() {
        let mut s = Secret::from_slice(b"abcdef").unwrap();
        let p = s.as_bytes().as_ptr();
        s.truncate(2);
        assert_eq!(s.as_bytes(), b"ab");
        // SAFETY: the bytes past len are still inside the live mapping.
        let tail = unsafe { std::slice::from_raw_parts(p.add(2), 4) };
        assert_eq!(tail, [0; 4]);
    }

    #[test]
    fn key_file_bounded_checked_and_warned() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("k");
        std::fs::File::create(&p)
            .unwrap()
            .write_all(b"pass\n")
            .unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        let k = read_key_file(&p, 64).unwrap();
        assert_eq!(k.secret.as_bytes(), b"pass\n");
        assert!(k.warning.is_none());

        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
        let k = read_key_file(&p, 64).unwrap();
        let w = k.warning.unwrap();
        assert!(
            w.contains("readable by group or others") && w.contains("0644"),
            "{w}"
        );

        let e = read_key_file(&p, 4).unwrap_err();
        assert!(e.contains("larger than 4 bytes"), "{e}");

        let empty = dir.path().join("empty");
        std::fs::File::create(&empty).unwrap();
        assert!(read_key_file(&empty, 64).unwrap_err().contains("empty"));

        // A FIFO is refused without blocking.
        let fifo = dir.path().join("fifo");
        let c = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let e = read_key_file(&fifo, 64).unwrap_err();
        assert!(e.contains("not a regular file"), "{e}");
        assert!(
            read_key_file(dir.path(), 64)
                .unwrap_err()
                .contains("not a regular file")
        );
    }

    #[test]
    fn key_fd_reads_a_pipe_to_its_end() {
        use std::os::fd::AsFd;
        let (r, mut w) = std::io::pipe().unwrap();
        w.write_all(b"secret").unwrap();
        drop(w);
        let k = read_key_fd(r.as_fd(), 64).unwrap();
        assert_eq!(k.secret.as_bytes(), b"secret");
        assert!(k.warning.is_none());
    }
}
