//! LUKS images for the tests, made by the reference tools: cryptsetup
//! (`luksFormat`, and `luksDump --dump-volume-key` as the oracle for the
//! volume key and the data offset), qemu-img and qemu-io with a
//! `--object secret`, and an independent decrypt of a payload with
//! Python's `cryptography` (AES-XTS, the tweak the offset in 512-byte
//! units, as dm-crypt's plain64 for LUKS). cryptsetup-bin and
//! python3-cryptography come from `scripts/format-deps.sh` when missing;
//! a test never skips for want of them.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;

use crate::qemu_img::{need_format_tools, need_qemu_img, runs};

/// The passphrase the images here are made with.
pub const PASS: &[u8] = b"pass";

/// Installs cryptsetup and python3-cryptography through the project's
/// script once; panics if they are still missing.
pub fn need_tools() {
    static READY: OnceLock<()> = OnceLock::new();
    READY.get_or_init(|| {
        need_format_tools("cryptsetup or python3-cryptography", || {
            runs("cryptsetup", &["--version"]) && runs("python3", &["-c", "import cryptography"])
        })
    });
}

/// A key file in `dir` holding `pass`, mode 0600.
pub fn key_file(dir: &Path, pass: &[u8]) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let p = dir.join(format!("key-{}", String::from_utf8_lossy(pass)));
    std::fs::write(&p, pass).unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
    p
}

/// Runs cryptsetup; panics with its output if it fails. Returns stdout.
pub fn cryptsetup(args: &[&str]) -> String {
    need_tools();
    let out = Command::new("cryptsetup")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("cryptsetup");
    assert!(
        out.status.success(),
        "cryptsetup {args:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `cryptsetup luksFormat --batch-mode ARGS` on a new sparse file of
/// `size` bytes in `dir`, with the passphrase [`PASS`].
pub fn format(dir: &Path, name: &str, size: u64, args: &[&str]) -> PathBuf {
    let img = dir.join(name);
    std::fs::File::create(&img).unwrap().set_len(size).unwrap();
    let key = key_file(dir, PASS);
    let mut all = vec![
        "luksFormat",
        "--batch-mode",
        "--key-file",
        key.to_str().unwrap(),
    ];
    all.extend_from_slice(args);
    all.push(img.to_str().unwrap());
    cryptsetup(&all);
    img
}

/// [`format`]'s arguments for a LUKS2 image with a PBKDF2 keyslot of
/// 1000 iterations (fast to open) and `sector` (`"512"` or `"4096"`)
/// byte sectors.
pub fn luks2_pbkdf2(sector: &'static str) -> [&'static str; 8] {
    [
        "--type",
        "luks2",
        "--pbkdf",
        "pbkdf2",
        "--pbkdf-force-iterations",
        "1000",
        "--sector-size",
        sector,
    ]
}

/// `qemu-img create ARGS` for an encrypted image. QEMU sizes the PBKDF2
/// iterations by timing a run against the thread's user time
/// (`getrusage(RUSAGE_THREAD)`), and fails with "Unable to get accurate
/// CPU usage" when that reads no time spent. On a guest kernel with tick
/// accounting it can for seconds on end: a tick the host steals is
/// counted to no task, and on a busy host every tick of the run may be.
/// Only that failure is answered: after three plain tries, qemu-img runs
/// with [`thread_clock_shim`], which reads the same user time from the
/// scheduler's own clock. The image is QEMU's either way; only the
/// iteration count its timing picks could differ.
pub fn qemu_img_create(args: &[&str]) {
    create_with_shim_from(args, 3);
}

/// [`qemu_img_create`] with [`thread_clock_shim`] from the first try: the
/// path a busy host takes, run on purpose by a test so that it is known
/// to work before it is needed.
pub fn qemu_img_create_under_shim(args: &[&str]) {
    create_with_shim_from(args, 0);
}

fn create_with_shim_from(args: &[&str], shim_from: usize) {
    need_qemu_img();
    let mut last = String::new();
    for attempt in 0..shim_from + 3 {
        let mut cmd = Command::new("qemu-img");
        if attempt >= shim_from {
            cmd.env("LD_PRELOAD", thread_clock_shim());
        }
        let out = cmd.args(args).output().unwrap();
        if out.status.success() {
            return;
        }
        last = String::from_utf8_lossy(&out.stderr).into_owned();
        if !last.contains("accurate CPU usage") {
            break;
        }
    }
    panic!("qemu-img {args:?}: {last}");
}

/// A preload library, built once a process with the system's C compiler,
/// whose `getrusage(RUSAGE_THREAD)` answers the user time from
/// `CLOCK_THREAD_CPUTIME_ID` (the scheduler's count of the thread's run
/// time, which no tick sampling or stolen tick leaves at zero); the other
/// fields, and every other `who`, are the C library's. For
/// [`qemu_img_create`]'s PBKDF2 timing only.
pub fn thread_clock_shim() -> &'static Path {
    static SHIM: OnceLock<PathBuf> = OnceLock::new();
    SHIM.get_or_init(|| {
        const SRC: &str = r#"
#define _GNU_SOURCE
#include <dlfcn.h>
#include <sys/resource.h>
#include <time.h>
int getrusage(int who, struct rusage *ru) {
    int (*real)(int, struct rusage *) = dlsym(RTLD_NEXT, "getrusage");
    int r = real(who, ru);
    struct timespec ts;
    if (r == 0 && who == RUSAGE_THREAD &&
        clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts) == 0) {
        ru->ru_utime.tv_sec = ts.tv_sec;
        ru->ru_utime.tv_usec = ts.tv_nsec / 1000;
    }
    return r;
}
"#;
        let dir = std::env::temp_dir().join(format!("ringblk-clock-shim-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let src = dir.join("shim.c");
        let lib = dir.join("shim.so");
        std::fs::write(&src, SRC).unwrap();
        let out = Command::new("cc")
            .args(["-shared", "-fPIC", "-O2", "-o"])
            .arg(&lib)
            .arg(&src)
            .output()
            .expect("cc (the system's C compiler) runs");
        assert!(
            out.status.success(),
            "cc of the thread-clock shim: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        lib
    })
}

/// A LUKS1 image of `size` bytes of payload made by `qemu-img create -f
/// luks` (PBKDF2 for 10 ms), with the passphrase [`PASS`].
pub fn qemu_img_luks(dir: &Path, name: &str, size: u64) -> PathBuf {
    luks1_by_qemu_img(dir, name, size, qemu_img_create)
}

/// [`qemu_img_luks`], qemu-img under [`thread_clock_shim`] from the first
/// try ([`qemu_img_create_under_shim`]).
pub fn qemu_img_luks_under_shim(dir: &Path, name: &str, size: u64) -> PathBuf {
    luks1_by_qemu_img(dir, name, size, qemu_img_create_under_shim)
}

fn luks1_by_qemu_img(dir: &Path, name: &str, size: u64, create: fn(&[&str])) -> PathBuf {
    let img = dir.join(name);
    let secret = format!("secret,id=s0,data={}", String::from_utf8_lossy(PASS));
    create(&[
        "create",
        "-f",
        "luks",
        "--object",
        &secret,
        "-o",
        "key-secret=s0,iter-time=10",
        img.to_str().unwrap(),
        &size.to_string(),
    ]);
    img
}

/// An encrypted qcow2 at `img`, as `qemu-img create -f qcow2 -o
/// encrypt.format=luks` makes it (PBKDF2 for 10 ms), with the passphrase
/// in the key file `key`; over `backing` (its name as the header stores
/// it, and its format) if given; of `size` (`"16M"`; `None`: the backing
/// file's).
pub fn qemu_img_qcow2_luks(
    img: &Path,
    key: &Path,
    backing: Option<(&str, &str)>,
    size: Option<&str>,
) {
    let secret = format!("secret,id=s0,file={}", key.display());
    let mut args = vec![
        "create",
        "-q",
        "-f",
        "qcow2",
        "--object",
        &secret,
        "-o",
        "encrypt.format=luks,encrypt.key-secret=s0,encrypt.iter-time=10",
    ];
    if let Some((name, format)) = backing {
        args.extend(["-b", name, "-F", format]);
    }
    args.push(img.to_str().expect("a UTF-8 path"));
    args.extend(size);
    qemu_img_create(&args);
}

/// The `--image-opts` QEMU opens a LUKS image `img` with, and the
/// `--object` holding its passphrase (from a key file in `dir`).
pub fn qemu_luks_opts(dir: &Path, img: &Path) -> (String, String) {
    let key = key_file(dir, PASS);
    (
        format!("secret,id=s0,file={}", key.display()),
        format!("driver=luks,key-secret=s0,file.filename={}", img.display()),
    )
}

/// The payload of `img` in plaintext, as QEMU's luks driver reads it
/// (`qemu-img convert -O raw`).
pub fn qemu_plaintext(dir: &Path, img: &Path) -> Vec<u8> {
    let (object, opts) = qemu_luks_opts(dir, img);
    qemu_convert(dir, &object, &opts)
}

/// What QEMU reads of the image `--image-opts opts` describes, its secret
/// in `--object object` (`qemu-img convert -O raw`, through a file in
/// `dir`).
pub fn qemu_convert(dir: &Path, object: &str, opts: &str) -> Vec<u8> {
    let out = dir.join("qemu-plain.raw");
    crate::qemu_img::qemu_img(&[
        "convert",
        "--object",
        object,
        "--image-opts",
        opts,
        "-O",
        "raw",
        out.to_str().unwrap(),
    ]);
    let data = std::fs::read(&out).unwrap();
    std::fs::remove_file(&out).unwrap();
    data
}

/// The volume key and the data offset in bytes, as cryptsetup dumps them.
pub fn dump(dir: &Path, img: &Path) -> (Vec<u8>, u64) {
    dump_with(&key_file(dir, PASS), img)
}

/// [`dump`], the passphrase in the file `key`.
pub fn dump_with(key: &Path, img: &Path) -> (Vec<u8>, u64) {
    let out = cryptsetup(&[
        "luksDump",
        "--dump-volume-key",
        "--batch-mode",
        "--key-file",
        key.to_str().unwrap(),
        img.to_str().unwrap(),
    ]);
    let hex: String = out
        .split_once("MK dump:")
        .expect("MK dump in luksDump")
        .1
        .split_whitespace()
        .take_while(|w| w.len() == 2 && w.chars().all(|c| c.is_ascii_hexdigit()))
        .collect();
    let key = (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
        .collect();
    // LUKS1: "Payload offset: N" (512-byte sectors); LUKS2: the data
    // segment's "offset: N [bytes]".
    let info = cryptsetup(&["luksDump", img.to_str().unwrap()]);
    let offset = if let Some((_, rest)) = info.split_once("Payload offset:") {
        rest.split_whitespace()
            .next()
            .unwrap()
            .parse::<u64>()
            .unwrap()
            * 512
    } else {
        let seg = info
            .split_once("Data segments:")
            .expect("LUKS2 data segments")
            .1;
        let (_, rest) = seg.split_once("offset:").expect("segment offset");
        rest.split_whitespace()
            .next()
            .unwrap()
            .parse::<u64>()
            .unwrap()
    };
    (key, offset)
}

/// The payload of `img` decrypted independently of ringblk: Python's
/// `cryptography` AES-XTS with the volume key cryptsetup dumps, over
/// `sector`-byte sectors from the data offset, each with the tweak
/// (its payload offset / 512) as a little-endian 128-bit number; `len`
/// bytes of payload.
pub fn independent_plaintext(dir: &Path, img: &Path, sector: usize, len: u64) -> Vec<u8> {
    let (key, offset) = dump(dir, img);
    let hexkey: String = key.iter().map(|b| format!("{b:02x}")).collect();
    let script = r#"
import sys
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
img, key, off, sector, n, out = sys.argv[1], bytes.fromhex(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
with open(img, 'rb') as f, open(out, 'wb') as o:
    f.seek(off)
    pos = 0
    while pos < n:
        c = f.read(sector)
        assert len(c) == sector, (pos, len(c))
        d = Cipher(algorithms.AES(key), modes.XTS((pos // 512).to_bytes(16, 'little'))).decryptor()
        o.write(d.update(c) + d.finalize())
        pos += sector
"#;
    let out = dir.join("python-plain.raw");
    let status = Command::new("python3")
        .args(["-c", script])
        .arg(img)
        .args([
            hexkey.as_str(),
            &offset.to_string(),
            &sector.to_string(),
            &len.to_string(),
        ])
        .arg(&out)
        .status()
        .expect("python3");
    assert!(status.success(), "the Python AES-XTS decrypt failed");
    let data = std::fs::read(&out).unwrap();
    std::fs::remove_file(&out).unwrap();
    data
}

/// Runs `qemu-io` on the LUKS image `img` with the commands `cmds`.
pub fn qemu_io(dir: &Path, img: &Path, cmds: &[&str]) -> String {
    let (object, opts) = qemu_luks_opts(dir, img);
    let mut args = vec!["--object", &object, "--image-opts", &opts];
    for c in cmds {
        args.extend(["-c", c]);
    }
    crate::qemu_img::run("qemu-io", &args)
}

/// Writes `data` into the payload of `img` at payload offset `at`,
/// encrypted independently of ringblk, as [`independent_plaintext`]
/// decrypts: `at` and `data.len()` multiples of `sector`.
pub fn independent_encrypt(dir: &Path, img: &Path, sector: usize, at: u64, data: &[u8]) {
    assert!(at.is_multiple_of(sector as u64) && data.len().is_multiple_of(sector));
    let (key, offset) = dump(dir, img);
    let hexkey: String = key.iter().map(|b| format!("{b:02x}")).collect();
    let script = r#"
import sys
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
img, key, off, sector, at, src = sys.argv[1], bytes.fromhex(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
plain = open(src, 'rb').read()
with open(img, 'r+b') as f:
    f.seek(off + at)
    for i in range(0, len(plain), sector):
        e = Cipher(algorithms.AES(key), modes.XTS(((at + i) // 512).to_bytes(16, 'little'))).encryptor()
        f.write(e.update(plain[i:i + sector]) + e.finalize())
"#;
    let src = dir.join("python-plain-in.raw");
    std::fs::write(&src, data).unwrap();
    let status = Command::new("python3")
        .args(["-c", script])
        .arg(img)
        .args([
            hexkey.as_str(),
            &offset.to_string(),
            &sector.to_string(),
            &at.to_string(),
        ])
        .arg(&src)
        .status()
        .expect("python3");
    assert!(status.success(), "the Python AES-XTS encrypt failed");
    std::fs::remove_file(&src).unwrap();
}
