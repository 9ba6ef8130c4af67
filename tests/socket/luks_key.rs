//! Where the key of `serve --format luks` must not be: the daemon's
//! `/proc/PID/cmdline` and `/proc/PID/environ` hold neither the passphrase
//! nor the volume key (hex or raw), and a core dump of the daemon (`gcore`,
//! which leaves out what the daemon marked `MADV_DONTDUMP`, as the kernel's
//! dumps do) holds neither the volume key, nor either of its two AES-256
//! keys, nor any round key of their expanded schedules (for encryption,
//! and the inverse-mixed ones AES-NI decrypts with), after the daemon
//! encrypted and decrypted on its queue thread.
//!
//! gdb (`gcore`) comes from `scripts/format-deps.sh` when missing; the
//! test never skips for want of it.

use std::path::Path;
use std::process::Command;

use ringblk_testkit::luks::{cryptsetup, dump_with, luks2_pbkdf2};
use ringblk_testkit::qemu_img::{need_format_tools, runs};
use ringblk_testkit::{Client, Daemon, DaemonOptions, MIB, pattern, test_dir};

/// A passphrase no other bytes of the daemon would hold by chance.
const PASSPHRASE: &[u8] = b"ringblk-Quixotic-Passphrase-7f3a9c";

/// Scans a core file (argv[1]) for the 64-byte XTS key (argv[2], hex),
/// its halves, and their AES-256 round keys (encryption schedule, and the
/// decryption schedule's InvMixColumns'd middle keys); prints one line
/// `FOUND what at core offset (vaddr)` per hit, then `SCANNED n`.
const SCAN: &str = r#"
import sys, struct
core = open(sys.argv[1], 'rb').read()
key = bytes.fromhex(sys.argv[2])
def mul(a, b):
    r = 0
    while b:
        if b & 1: r ^= a
        a = ((a << 1) ^ 0x11b) if a & 0x80 else (a << 1)
        b >>= 1
    return r
def inv(a):
    r = 1
    for _ in range(254): r = mul(r, a)
    return r if a else 0
def rotl(b, n): return ((b << n) | (b >> (8 - n))) & 0xff
SBOX = [(lambda b: b ^ rotl(b, 1) ^ rotl(b, 2) ^ rotl(b, 3) ^ rotl(b, 4) ^ 0x63)(inv(a)) for a in range(256)]
def expand(k):
    w = [list(k[4 * i:4 * i + 4]) for i in range(8)]
    rcon = 1
    for i in range(8, 60):
        t = list(w[i - 1])
        if i % 8 == 0:
            t = [SBOX[x] for x in t[1:] + t[:1]]
            t[0] ^= rcon
            rcon = mul(rcon, 2)
        elif i % 8 == 4:
            t = [SBOX[x] for x in t]
        w.append([a ^ b for a, b in zip(w[i - 8], t)])
    return [bytes(sum(w[4 * r:4 * r + 4], [])) for r in range(15)]
def inv_mix(rk):
    out = []
    for c in range(4):
        a = rk[4 * c:4 * c + 4]
        out += [mul(a[0], 14) ^ mul(a[1], 11) ^ mul(a[2], 13) ^ mul(a[3], 9),
                mul(a[0], 9) ^ mul(a[1], 14) ^ mul(a[2], 11) ^ mul(a[3], 13),
                mul(a[0], 13) ^ mul(a[1], 9) ^ mul(a[2], 14) ^ mul(a[3], 11),
                mul(a[0], 11) ^ mul(a[1], 13) ^ mul(a[2], 9) ^ mul(a[3], 14)]
    return bytes(out)
# FIPS-197 C.3: the last round key of AES-256 with the key 00..1f.
assert expand(bytes(range(32)))[14].hex() == '24fc79ccbf0979e9371ac23c6d68de36'
needles = [('the volume key', key)]
for h, half in (('first', key[:32]), ('second', key[32:])):
    needles.append(('the %s AES key' % h, half))
    rks = expand(half)
    for r in range(2, 15):
        needles.append(('round key %d of the %s AES key' % (r, h), rks[r]))
    for r in range(1, 14):
        needles.append(('decryption round key %d of the %s AES key' % (r, h), inv_mix(rks[r])))
# The ELF program headers, to name where a hit lies.
phoff, = struct.unpack_from('<Q', core, 32)
phentsize, phnum = struct.unpack_from('<HH', core, 54)
loads = []
for i in range(phnum):
    t, _, off, vaddr, _, filesz = struct.unpack_from('<IIQQQQ', core, phoff + i * phentsize)
    if t == 1: loads.append((off, filesz, vaddr))
def where(o):
    for off, n, vaddr in loads:
        if off <= o < off + n: return '0x%x' % (vaddr + o - off)
    return 'no segment'
for what, n in needles:
    at = core.find(n)
    while at >= 0:
        print('FOUND %s at core offset %d (vaddr %s)' % (what, at, where(at)))
        at = core.find(n, at + 1)
print('SCANNED %d' % len(needles))
"#;

fn need_gdb() {
    need_format_tools("gdb (gcore)", || {
        runs("gdb", &["--version"]) && runs("which", &["gcore"])
    });
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

/// The problems with `what` (a /proc file's bytes): any form of the secrets.
fn leaks(what: &str, bytes: &[u8], volume_key: &[u8]) -> Vec<String> {
    let forms: [(&str, Vec<u8>); 4] = [
        ("the passphrase", PASSPHRASE.to_vec()),
        ("the volume key", volume_key.to_vec()),
        ("the volume key in hex", hex(volume_key).into_bytes()),
        (
            "the volume key in upper-case hex",
            hex(volume_key).to_uppercase().into_bytes(),
        ),
    ];
    forms
        .iter()
        .filter(|(_, f)| contains(bytes, f))
        .map(|(name, _)| format!("{what} holds {name}"))
        .collect()
}

fn image(dir: &Path) -> (std::path::PathBuf, std::path::PathBuf) {
    use std::os::unix::fs::PermissionsExt;
    // Named for nothing in it: a path is in the command line.
    let key = dir.join("disk.key");
    std::fs::write(&key, PASSPHRASE).unwrap();
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).unwrap();
    let img = dir.join("disk.img");
    std::fs::File::create(&img)
        .unwrap()
        .set_len(24 * MIB)
        .unwrap();
    let mut args = vec!["luksFormat", "--batch-mode"];
    args.extend(luks2_pbkdf2("512"));
    args.extend(["--key-file", key.to_str().unwrap(), img.to_str().unwrap()]);
    cryptsetup(&args);
    (img, key)
}

#[test]
fn the_key_is_in_no_proc_file_and_no_core_dump() {
    need_gdb();
    let dir = test_dir();
    let (img, key) = image(dir.path());
    let (volume_key, _) = dump_with(&key, &img);
    assert_eq!(volume_key.len(), 64, "an AES-256-XTS key");
    let d = Daemon::start_in(
        dir.path(),
        DaemonOptions {
            image: Some(img.clone()),
            args: &["--format", "luks", "--key-file", key.to_str().unwrap()],
            ..DaemonOptions::default()
        },
    );
    // The key at work on the queue thread: encrypt, then decrypt.
    let mut c = Client::connect(&d.socket, 1 << 20);
    let data = pattern(3, MIB, 256 * 1024);
    assert_eq!(c.write(MIB, &data), 0);
    assert_eq!(c.read(MIB, data.len()), data);
    assert_eq!(c.flush(), 0);

    let pid = d.pid();
    let mut problems = Vec::new();
    for file in ["cmdline", "environ"] {
        let path = format!("/proc/{pid}/{file}");
        let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
        assert!(!bytes.is_empty(), "{path} is empty");
        problems.extend(leaks(&path, &bytes, &volume_key));
    }

    // Where a hit lies, if one does: the mappings, and each thread's
    // name and stack pointer.
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap_or_default();
    let threads = Command::new("gdb")
        .args([
            "-p",
            &pid.to_string(),
            "-batch",
            "-ex",
            "thread apply all info registers rsp",
        ])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default();
    // The daemon stopped for a moment, its memory copied out as the
    // kernel would dump it (gdb leaves out MADV_DONTDUMP mappings).
    let prefix = dir.path().join("core");
    let out = Command::new("gcore")
        .arg("-o")
        .arg(&prefix)
        .arg(pid.to_string())
        .output()
        .expect("gcore");
    let core = dir.path().join(format!("core.{pid}"));
    assert!(
        out.status.success() && core.exists(),
        "gcore {pid}: {:?}\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let core_len = std::fs::metadata(&core).unwrap().len();
    // The client still works: the daemon went on after gcore detached.
    assert_eq!(c.read(MIB, data.len()), data);
    drop(c);
    drop(d);
    // The scan's own check: it finds the key where it is.
    let planted = dir.path().join("planted");
    let mut bytes = std::fs::read(&core).unwrap();
    bytes.extend_from_slice(&volume_key);
    std::fs::write(&planted, &bytes).unwrap();
    drop(bytes);
    let scan = |file: &Path| {
        let out = Command::new("python3")
            .args(["-c", SCAN])
            .arg(file)
            .arg(hex(&volume_key))
            .output()
            .expect("python3");
        assert!(
            out.status.success(),
            "the core scan failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let planted_scan = scan(&planted);
    assert!(
        planted_scan.contains("FOUND the volume key")
            && planted_scan.contains("FOUND the first AES key"),
        "the scan misses a key planted in the core:\n{planted_scan}"
    );
    std::fs::remove_file(&planted).unwrap();
    let report = scan(&core);
    eprintln!("core of {core_len} bytes scanned: {}", report.trim());
    problems.extend(
        report
            .lines()
            .filter(|l| l.starts_with("FOUND"))
            .map(|l| format!("the core dump: {l}")),
    );
    assert!(
        problems.is_empty(),
        "the key leaked:\n  {}\n==== the daemon's threads ====\n{threads}\n==== its mappings ====\n{maps}",
        problems.join("\n  ")
    );
}
