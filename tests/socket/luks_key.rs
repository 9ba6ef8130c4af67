//! Where the key of `serve --format luks` must not be: the daemon's
//! `/proc/PID/cmdline` and `/proc/PID/environ` hold neither the passphrase
//! nor the volume key (hex or raw), and a core dump of the daemon (`gcore`,
//! which leaves out what the daemon marked `MADV_DONTDUMP`, as the kernel's
//! dumps do) holds neither the volume key, nor either of its two AES-256
//! keys, nor any round key of their expanded schedules (for encryption,
//! and the inverse-mixed ones AES-NI decrypts with), after the daemon
//! encrypted and decrypted on its queue thread; and the same for an
//! encrypted qcow2 chain's two volume keys, after its metadata thread
//! copied clusters up (decrypting and encrypting) and a backup's NBD
//! thread read its export (decrypting).
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

/// The key file holding [`PASSPHRASE`], mode 0600.
fn passphrase_file(dir: &Path) -> std::path::PathBuf {
    use std::os::unix::fs::PermissionsExt;
    // Named for nothing in it: a path is in the command line.
    let key = dir.join("disk.key");
    std::fs::write(&key, PASSPHRASE).unwrap();
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).unwrap();
    key
}

fn image(dir: &Path) -> (std::path::PathBuf, std::path::PathBuf) {
    let key = passphrase_file(dir);
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

    assert_no_key(dir.path(), d, &mut c, &data, &[volume_key]);
}

/// The volume key of the encrypted qcow2 layer `img`, as cryptsetup
/// dumps it from the LUKS header region (the crypt header extension's)
/// copied out to a file of its own.
fn qcow2_volume_key(dir: &Path, img: &Path, key: &Path) -> Vec<u8> {
    let data = std::fs::read(img).unwrap();
    let be32 = |at: usize| u32::from_be_bytes(data[at..at + 4].try_into().unwrap());
    let be64 = |at: usize| u64::from_be_bytes(data[at..at + 8].try_into().unwrap());
    let mut at = be32(100) as usize;
    let (base, len) = loop {
        let (kind, n) = (be32(at), be32(at + 4) as usize);
        assert_ne!(kind, 0, "{}: no crypt header extension", img.display());
        if kind == 0x0537_be77 {
            break (be64(at + 8) as usize, be64(at + 16) as usize);
        }
        at += 8 + n.div_ceil(8) * 8;
    };
    let region = dir.join("region");
    std::fs::write(&region, &data[base..base + len]).unwrap();
    let (volume_key, _) = dump_with(key, &region);
    std::fs::remove_file(&region).unwrap();
    volume_key
}

/// An encrypted qcow2 chain (two layers, each its own volume key) at
/// work off the queue threads too: partial writes copied up from the
/// base on the metadata thread (decrypted with the base's key, encrypted
/// with the top's), and a backup whose export the NBD thread reads,
/// decrypting. Neither key, nor any round key, is in a core dump after.
#[test]
fn an_encrypted_qcow2_chain_leaves_no_key_on_any_thread() {
    use ringblk_testkit::nbd::{self, backup_start};
    need_gdb();
    assert!(nbd::have_tools(), "nbdcopy is needed");
    let dir = test_dir();
    let d = dir.path();
    let key = passphrase_file(d);
    let secret = format!("secret,id=s0,file={}", key.display());
    let create = |name: &str, backing: Option<&str>| {
        let img = d.join(name);
        let backing = backing.map(|b| (b, "qcow2"));
        ringblk_testkit::luks::qemu_img_qcow2_luks(&img, &key, backing, Some("16M"));
        img
    };
    let base = create("base.qcow2", None);
    let opts = format!(
        "driver=qcow2,file.filename={},encrypt.key-secret=s0",
        base.display()
    );
    ringblk_testkit::qemu_img::run(
        "qemu-io",
        &[
            "--object",
            &secret,
            "--image-opts",
            &opts,
            "-c",
            "write -P 0x5a 0 8M",
        ],
    );
    let top = create("top.qcow2", Some("base.qcow2"));
    let keys = [
        qcow2_volume_key(d, &top, &key),
        qcow2_volume_key(d, &base, &key),
    ];
    assert_ne!(keys[0], keys[1], "each layer has a volume key of its own");
    let api = d.join("api.sock");
    let backups = d.join("backups");
    std::fs::create_dir(&backups).unwrap();
    let daemon = Daemon::start_in(
        d,
        DaemonOptions {
            image: Some(top.clone()),
            args: &[
                "--format",
                "qcow2",
                "--key-file",
                key.to_str().unwrap(),
                "--api",
                api.to_str().unwrap(),
                "--backup-dir",
                backups.to_str().unwrap(),
            ],
            ..DaemonOptions::default()
        },
    );
    let mut c = Client::connect(&daemon.socket, 1 << 20);
    // Partial writes into clusters only the base has: copy-up.
    for i in 0..16u64 {
        let off = i * 512 * 1024 + 4096;
        assert_eq!(c.write(off, &pattern(i, off, 8192)), 0);
    }
    let data = pattern(3, MIB, 256 * 1024);
    assert_eq!(c.write(MIB, &data), 0);
    assert_eq!(c.read(MIB, data.len()), data);
    assert_eq!(c.flush(), 0);
    let sock = backup_start(&api, &backups, "full.sock", None);
    let copy = d.join("copy.raw");
    let out = Command::new("nbdcopy")
        .arg(nbd::uri(&sock))
        .arg(&copy)
        .output()
        .expect("nbdcopy");
    assert!(
        out.status.success(),
        "nbdcopy: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        &std::fs::read(&copy).unwrap()[MIB as usize..][..data.len()],
        &data[..],
        "the export's plaintext"
    );
    ringblk_testkit::ctl_ok(&api, &["backup", "stop"]);
    assert_no_key(d, daemon, &mut c, &data, &keys);
}

/// Checks `d` (serving, `c` its client, which reads `data` back at 1 MiB)
/// for `keys`: `/proc/PID/cmdline` and `environ` hold none of them nor
/// the passphrase, and a core dump (`gcore`) holds neither a key nor its
/// AES keys nor any of their round keys; the client still reads after the
/// dump. Stops the daemon.
fn assert_no_key(dir: &Path, d: Daemon, c: &mut Client, data: &[u8], keys: &[Vec<u8>]) {
    let pid = d.pid();
    let mut problems = Vec::new();
    for file in ["cmdline", "environ"] {
        let path = format!("/proc/{pid}/{file}");
        let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
        assert!(!bytes.is_empty(), "{path} is empty");
        for key in keys {
            problems.extend(leaks(&path, &bytes, key));
        }
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
    let prefix = dir.join("core");
    let out = Command::new("gcore")
        .arg("-o")
        .arg(&prefix)
        .arg(pid.to_string())
        .output()
        .expect("gcore");
    let core = dir.join(format!("core.{pid}"));
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
    drop(d);
    // The scan's own check: it finds the key where it is.
    let planted = dir.join("planted");
    let mut bytes = std::fs::read(&core).unwrap();
    bytes.extend_from_slice(&keys[0]);
    std::fs::write(&planted, &bytes).unwrap();
    drop(bytes);
    let scan = |file: &Path, key: &[u8]| {
        let out = Command::new("python3")
            .args(["-c", SCAN])
            .arg(file)
            .arg(hex(key))
            .output()
            .expect("python3");
        assert!(
            out.status.success(),
            "the core scan failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let planted_scan = scan(&planted, &keys[0]);
    assert!(
        planted_scan.contains("FOUND the volume key")
            && planted_scan.contains("FOUND the first AES key"),
        "the scan misses a key planted in the core:\n{planted_scan}"
    );
    std::fs::remove_file(&planted).unwrap();
    for (n, key) in keys.iter().enumerate() {
        let report = scan(&core, key);
        eprintln!(
            "core of {core_len} bytes scanned for key {n}: {}",
            report.trim()
        );
        problems.extend(
            report
                .lines()
                .filter(|l| l.starts_with("FOUND"))
                .map(|l| format!("the core dump, key {n}: {l}")),
        );
    }
    assert!(
        problems.is_empty(),
        "the key leaked:\n  {}\n==== the daemon's threads ====\n{threads}\n==== its mappings ====\n{maps}",
        problems.join("\n  ")
    );
}
