//! `serve --format luks` through libblkio, with the reference tools as
//! the oracles: images made by `cryptsetup luksFormat` (LUKS2 with 512-
//! and 4096-byte sectors, PBKDF2 and Argon2id; LUKS1) and by `qemu-img
//! create -f luks`; what the client wrote, decrypted independently
//! (cryptsetup's volume key, Python's AES-XTS), and read by QEMU's luks
//! driver (`qemu-img convert`); what qemu-io wrote, read through ringblk;
//! write-zeroes, restarts, and the refusals, each one line.
//!
//! The daemons run with the default `--seccomp enforce`: the encryption
//! runs on the queue threads after the sandbox closed.

use std::path::Path;
use std::time::Duration;

use ringblk_testkit::luks::{
    PASS, format, independent_plaintext, key_file, luks2_pbkdf2, qemu_img_luks,
    qemu_img_luks_under_shim, qemu_io, qemu_plaintext,
};
use ringblk_testkit::{Client, Daemon, DaemonOptions, KIB, MIB, pattern, serve_refused, test_dir};

/// The writes each test makes (offset, length, seed): aligned to 4 KiB
/// (so valid for either sector size), one across a 64 KiB boundary, one
/// large, one at the end of the payload.
fn writes(size: u64) -> Vec<(u64, usize, u64)> {
    vec![
        (0, 4096, 1),
        (60 * KIB, 8192, 2),
        (MIB, 512 * KIB as usize, 3),
        (size - 8192, 8192, 4),
    ]
}

/// Serves `img` as luks with the key file for [`PASS`].
fn serve(dir: &Path, img: &Path, extra: &[&str]) -> Daemon {
    let key = key_file(dir, PASS);
    let mut args = vec!["--format", "luks", "--key-file", key.to_str().unwrap()];
    args.extend_from_slice(extra);
    Daemon::start_in(
        dir,
        DaemonOptions {
            image: Some(img.to_path_buf()),
            args: &args,
            ..DaemonOptions::default()
        },
    )
}

/// Writes the patterns of [`writes`] through the daemon, reads them
/// back, flushes; returns the guest's disk as it must now read (zeroes
/// where nothing was written are not known: `None` there).
fn write_patterns(c: &mut Client) -> Vec<(u64, Vec<u8>)> {
    let mut out = Vec::new();
    for (off, len, seed) in writes(c.capacity) {
        let data = pattern(seed, off, len);
        assert_eq!(c.write(off, &data), 0, "write at {off}");
        assert_eq!(c.read(off, len), data, "read back at {off}");
        out.push((off, data));
    }
    assert_eq!(c.flush(), 0);
    out
}

fn assert_holds(what: &str, plain: &[u8], written: &[(u64, Vec<u8>)]) {
    for (off, data) in written {
        let got = &plain[*off as usize..*off as usize + data.len()];
        if let Some(i) = got.iter().zip(data).position(|(a, b)| a != b) {
            panic!(
                "{what}: byte {} differs from what the client wrote",
                off + i as u64
            );
        }
    }
}

/// Through ringblk, then decrypted by Python with cryptsetup's volume key;
/// and, for LUKS1, by QEMU.
fn round_trip(
    name: &str,
    size: u64,
    format_args: &[&str],
    sector: usize,
    luks1: bool,
    serve_args: &[&str],
) {
    let dir = test_dir();
    let img = format(dir.path(), name, size, format_args);
    let mut d = serve(dir.path(), &img, serve_args);
    let mut c = Client::connect(&d.socket, 1 << 20);
    let payload = c.capacity;
    assert!(payload > 0 && payload < size, "payload {payload}");
    assert_eq!(
        c.request_alignment as usize, sector,
        "the guest's block is the LUKS sector"
    );
    let written = write_patterns(&mut c);
    drop(c);
    d.signal_and_wait(libc::SIGTERM, Duration::from_secs(20));
    let plain = independent_plaintext(dir.path(), &img, sector, payload);
    assert_holds("Python's AES-XTS", &plain, &written);
    if luks1 {
        assert_holds(
            "qemu-img convert",
            &qemu_plaintext(dir.path(), &img),
            &written,
        );
    }
}

#[test]
fn luks2_512_byte_sectors_pbkdf2() {
    round_trip(
        "l2-512.img",
        24 * MIB,
        &luks2_pbkdf2("512"),
        512,
        false,
        &[],
    );
}

#[test]
fn luks2_4096_byte_sectors_argon2id() {
    round_trip(
        "l2-4k.img",
        24 * MIB,
        &[
            "--type",
            "luks2",
            "--pbkdf",
            "argon2id",
            "--pbkdf-memory",
            "32",
            "--pbkdf-force-iterations",
            "4",
            "--sector-size",
            "4096",
        ],
        4096,
        false,
        &[],
    );
}

/// O_DIRECT: writes go from the staged buffers (page-aligned) as they
/// are; reads land in the guest's buffers (or a bounce buffer) first.
#[test]
fn luks2_4096_byte_sectors_direct() {
    round_trip(
        "l2-direct.img",
        24 * MIB,
        &luks2_pbkdf2("4096"),
        4096,
        false,
        &["--direct"],
    );
}

#[test]
fn luks1_from_cryptsetup() {
    round_trip(
        "l1.img",
        8 * MIB,
        &[
            "--type",
            "luks1",
            "--pbkdf-force-iterations",
            "1000",
            "--hash",
            "sha256",
        ],
        512,
        true,
        &[],
    );
}

/// qemu-img made it and qemu-io wrote into it: ringblk reads what qemu-io
/// wrote; then QEMU reads what ringblk wrote.
#[test]
fn qemu_img_luks_both_ways() {
    let dir = test_dir();
    let img = qemu_img_luks(dir.path(), "q.luks", 8 * MIB);
    qemu_io(
        dir.path(),
        &img,
        &["write -P 0xab 0 64k", "write -P 0xcd 4M 4k"],
    );
    let mut d = serve(dir.path(), &img, &[]);
    let mut c = Client::connect(&d.socket, 1 << 20);
    assert_eq!(c.capacity, 8 * MIB);
    assert_eq!(c.read(0, 64 * KIB as usize), vec![0xab; 64 * KIB as usize]);
    assert_eq!(c.read(4 * MIB, 4096), vec![0xcd; 4096]);
    let written = write_patterns(&mut c);
    drop(c);
    d.signal_and_wait(libc::SIGTERM, Duration::from_secs(20));
    let plain = qemu_plaintext(dir.path(), &img);
    assert_holds("qemu-img convert", &plain, &written);
    // Untouched by ringblk's writes: qemu-io's 0xcd at 4 MiB.
    assert_eq!(
        &plain[4 * MIB as usize..4 * MIB as usize + 4096],
        &[0xcd; 4096][..]
    );
}

/// The path the kit takes when qemu-img's PBKDF2 timing reads no CPU
/// time (a busy host): qemu-img under the thread-clock shim still makes a
/// LUKS image, which ringblk serves and QEMU reads back.
#[test]
fn qemu_img_under_the_thread_clock_shim() {
    let dir = test_dir();
    let img = qemu_img_luks_under_shim(dir.path(), "shim.luks", 4 * MIB);
    let mut d = serve(dir.path(), &img, &[]);
    let mut c = Client::connect(&d.socket, 1 << 20);
    assert_eq!(c.capacity, 4 * MIB);
    let written = write_patterns(&mut c);
    drop(c);
    d.signal_and_wait(libc::SIGTERM, Duration::from_secs(20));
    assert_holds(
        "qemu-img convert",
        &qemu_plaintext(dir.path(), &img),
        &written,
    );
}

/// Write-zeroes writes encrypted zeroes (a hole would decrypt to noise):
/// they read back as zeroes, through ringblk and independently; a
/// discard succeeds.
#[test]
fn write_zeroes_read_back_as_zeroes() {
    let dir = test_dir();
    let img = format(dir.path(), "z.img", 24 * MIB, &luks2_pbkdf2("512"));
    let mut d = serve(dir.path(), &img, &[]);
    let mut c = Client::connect(&d.socket, 2 << 20);
    let data = pattern(9, 0, 2 * MIB as usize);
    assert_eq!(c.write(0, &data[..MIB as usize]), 0);
    assert_eq!(c.write(MIB, &data[MIB as usize..]), 0);
    // At most 1 MiB each on an encrypted disk (max_write_zeroes_sectors).
    assert_eq!(c.write_zeroes(64 * KIB, MIB), 0);
    assert_eq!(c.write_zeroes(1088 * KIB, 512 * KIB), 0);
    assert!(
        c.write_zeroes(0, 2 * MIB) < 0,
        "past the advertised maximum"
    );
    assert_eq!(
        c.read(64 * KIB, 1536 * KIB as usize),
        vec![0; 1536 * KIB as usize]
    );
    assert_eq!(c.read(0, 64 * KIB as usize), &data[..64 * KIB as usize]);
    assert_eq!(c.discard(4 * MIB, MIB), 0);
    assert_eq!(c.flush(), 0);
    let payload = c.capacity;
    drop(c);
    d.signal_and_wait(libc::SIGTERM, Duration::from_secs(20));
    let plain = independent_plaintext(dir.path(), &img, 512, payload);
    assert!(
        plain[64 * KIB as usize..1600 * KIB as usize]
            .iter()
            .all(|&b| b == 0)
    );
    assert_eq!(
        &plain[1600 * KIB as usize..2 * MIB as usize],
        &data[1600 * KIB as usize..]
    );
}

/// What was flushed survives a clean restart and a kill -9.
#[test]
fn restarts_read_back_what_was_flushed() {
    let dir = test_dir();
    let img = format(dir.path(), "r.img", 24 * MIB, &luks2_pbkdf2("4096"));
    let mut d = serve(dir.path(), &img, &[]);
    let mut c = Client::connect(&d.socket, 1 << 20);
    let first = write_patterns(&mut c);
    drop(c);
    d.signal_and_wait(libc::SIGTERM, Duration::from_secs(20));
    drop(d);
    let mut d = serve(dir.path(), &img, &[]);
    let mut c = Client::connect(&d.socket, 1 << 20);
    for (off, data) in &first {
        assert_eq!(&c.read(*off, data.len()), data, "after a restart, at {off}");
    }
    let data = pattern(7, 2 * MIB, 256 * KIB as usize);
    assert_eq!(c.write(2 * MIB, &data), 0);
    assert_eq!(c.flush(), 0);
    drop(c);
    d.signal_and_wait(libc::SIGKILL, Duration::from_secs(20));
    drop(d);
    let d = serve(dir.path(), &img, &[]);
    let mut c = Client::connect(&d.socket, 1 << 20);
    assert_eq!(c.read(2 * MIB, data.len()), data, "after kill -9");
    assert_eq!(&c.read(first[0].0, first[0].1.len()), &first[0].1);
}

/// A wrong passphrase, a missing key file, no key at all, a cipher that
/// is not aes-xts-plain64 and a block size that is not the LUKS sector:
/// one line each, exit status 1, nothing served.
#[test]
fn bad_input_is_refused_with_one_line() {
    let dir = test_dir();
    let img = format(dir.path(), "b.img", 24 * MIB, &luks2_pbkdf2("4096"));
    let image = img.to_str().unwrap();
    let wrong = key_file(dir.path(), b"wrong");
    let line = serve_refused(
        dir.path(),
        &[],
        &[
            "--image",
            image,
            "--format",
            "luks",
            "--key-file",
            wrong.to_str().unwrap(),
        ],
    );
    assert!(line.contains("wrong passphrase"), "{line}");
    let missing = dir.path().join("nope");
    let line = serve_refused(
        dir.path(),
        &[],
        &[
            "--image",
            image,
            "--format",
            "luks",
            "--key-file",
            missing.to_str().unwrap(),
        ],
    );
    assert!(line.contains("key file") && line.contains("nope"), "{line}");
    let line = usage_error(dir.path(), &["--image", image, "--format", "luks"]);
    assert!(line.contains("--key-file"), "{line}");
    let key = key_file(dir.path(), PASS);
    let key = key.to_str().unwrap();
    let line = usage_error(
        dir.path(),
        &[
            "--image",
            image,
            "--format",
            "luks",
            "--key-file",
            key,
            "--block-size",
            "512",
        ],
    );
    assert!(line.contains("4096-byte sectors"), "{line}");
    // cryptsetup checks a non-AES cipher through device-mapper, which a
    // machine without dm-crypt lacks: serpent is written into a LUKS1
    // header cryptsetup made, where it would have written it.
    let serpent = format(
        dir.path(),
        "s.img",
        8 * MIB,
        &["--type", "luks1", "--pbkdf-force-iterations", "1000"],
    );
    let mut b = std::fs::read(&serpent).unwrap();
    b[8..40].fill(0);
    b[8..15].copy_from_slice(b"serpent");
    std::fs::write(&serpent, &b).unwrap();
    let line = serve_refused(
        dir.path(),
        &[],
        &[
            "--image",
            serpent.to_str().unwrap(),
            "--format",
            "luks",
            "--key-file",
            key,
        ],
    );
    assert!(
        line.contains("aes-xts-plain64"),
        "names what is supported: {line}"
    );
    let line = usage_error(dir.path(), &["--image", image, "--key-file", key]);
    assert!(line.contains("--format luks"), "{line}");
}

/// Runs `ringblk serve ARGS`, expects a usage error (exit status 2) and
/// returns its first line.
fn usage_error(dir: &Path, args: &[&str]) -> String {
    let out = std::process::Command::new(ringblk_testkit::ringblk_bin())
        .arg("serve")
        .arg("--socket")
        .arg(dir.join("usage.sock"))
        .args(args)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
    assert!(!dir.join("usage.sock").exists(), "nothing is served");
    err.lines().next().unwrap_or_default().to_string()
}

/// The passphrase from an inherited descriptor (a pipe, as a secret
/// store hands it over) opens the image too.
#[test]
fn key_from_an_inherited_descriptor() {
    use std::io::Write;
    use std::os::fd::AsRawFd;
    use std::os::unix::process::CommandExt;
    let dir = test_dir();
    let img = qemu_img_luks(dir.path(), "fd.luks", 4 * MIB);
    qemu_io(dir.path(), &img, &["write -P 0x5a 1M 64k"]);
    let (r, mut w) = std::io::pipe().unwrap();
    w.write_all(PASS).unwrap();
    drop(w);
    let rfd = r.as_raw_fd();
    let configure = move |cmd: &mut std::process::Command| {
        // SAFETY: dup2 or fcntl in the child between fork and exec: one
        // async-signal-safe syscall on descriptors the child inherited.
        // The pipe may already be fd 5 (tests open and close descriptors
        // in parallel), where dup2 would leave its close-on-exec flag set.
        unsafe {
            cmd.pre_exec(move || {
                let done = if rfd == 5 {
                    libc::fcntl(5, libc::F_SETFD, 0)
                } else {
                    libc::dup2(rfd, 5)
                };
                if done < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    };
    let d = Daemon::start_in(
        dir.path(),
        DaemonOptions {
            image: Some(img.clone()),
            args: &["--format", "luks", "--key-fd", "5"],
            configure: Some(&configure),
            ..DaemonOptions::default()
        },
    );
    drop(r);
    let mut c = Client::connect(&d.socket, 1 << 20);
    assert_eq!(
        c.read(MIB, 64 * KIB as usize),
        vec![0x5a; 64 * KIB as usize]
    );
}

/// A key file readable by others gets a WARN line.
#[test]
fn loose_key_file_warned() {
    use std::os::unix::fs::PermissionsExt;
    let dir = test_dir();
    let img = qemu_img_luks(dir.path(), "w.luks", 4 * MIB);
    let key = key_file(dir.path(), PASS);
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o644)).unwrap();
    let d = Daemon::start_in(
        dir.path(),
        DaemonOptions {
            image: Some(img),
            args: &["--format", "luks", "--key-file", key.to_str().unwrap()],
            ..DaemonOptions::default()
        },
    );
    let log = d.log();
    assert!(
        log.lines()
            .any(|l| l.contains("WARN") && l.contains("readable by group or others")),
        "{log}"
    );
}

/// Writes pattern `seed` over `[off, off + len)` in 1 MiB requests.
fn write_pattern(c: &mut Client, seed: u64, off: u64, len: u64) {
    let mut at = off;
    while at < off + len {
        let n = (off + len - at).min(MIB) as usize;
        assert_eq!(c.write(at, &pattern(seed, at, n)), 0, "write at {at}");
        at += n as u64;
    }
}

/// Asserts `got` (a file) holds `want`, naming the first differing byte.
#[track_caller]
fn assert_file_is(what: &str, got: &Path, want: &[u8]) {
    let got = std::fs::read(got).unwrap();
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) {
        panic!("{what}: byte {i} differs from the plaintext");
    }
}

/// Backups of a LUKS2 image (4096-byte sectors), by the clients of
/// docs/backup.md, under the default seccomp filter: the export serves
/// the guest's plaintext. A full backup copied by nbdcopy while the guest
/// overwrites is the plaintext at the instant (Python's decrypt with
/// cryptsetup's volume key), where nothing was ever written too (there
/// the payload is a hole of the file, which decrypts to noise: reported
/// as a hole, nbdcopy would write zeroes); the incremental's dirty map is
/// what the guest wrote since; full + incremental, restored by qemu-img,
/// is the plaintext at the second start.
#[test]
fn backups_serve_the_plaintext_at_the_instant() {
    use ringblk_testkit::ctl_ok;
    use ringblk_testkit::nbd::{self, backup_start, dirty, granules};
    const GRAN: u64 = 64 * KIB;
    if !nbd::have_tools() {
        return;
    }
    let dir = test_dir();
    let img = format(dir.path(), "b.luks", 48 * MIB, &luks2_pbkdf2("4096"));
    let api = dir.path().join("api.sock");
    let backups = dir.path().join("backups");
    std::fs::create_dir(&backups).unwrap();
    let d = serve(
        dir.path(),
        &img,
        &[
            "--api",
            api.to_str().unwrap(),
            "--backup-dir",
            backups.to_str().unwrap(),
        ],
    );
    let plaintext = |name: &str, size: u64| {
        let p = dir.path().join(name);
        std::fs::write(&p, independent_plaintext(dir.path(), &img, 4096, size)).unwrap();
        p
    };
    ctl_ok(&api, &["bitmap", "add", "inc"]);
    let mut c = Client::connect(&d.socket, MIB as usize);
    let size = c.capacity;
    write_pattern(&mut c, 1, 0, 16 * MIB);
    assert_eq!(c.flush(), 0);
    let at_first = std::fs::read(plaintext("at-first.raw", size)).unwrap();

    let sock = backup_start(&api, &backups, "full.sock", Some("inc"));
    assert_eq!(
        dirty(&sock, "inc"),
        granules(&[(0, 16 * MIB)], GRAN, size),
        "the first export's map"
    );
    // All data: the never-written half is a hole of the file, which
    // decrypts to noise, not zeroes.
    let map = nbd::map(&sock, None);
    assert!(
        map.iter().all(|e| e.2 == 0) && map.iter().map(|e| e.1).sum::<u64>() == size,
        "base:allocation: {map:?}"
    );
    // The guest overwrites most of the disk while nbdcopy copies.
    let copy = dir.path().join("copy.raw");
    let running = std::process::Command::new("nbdcopy")
        .arg(nbd::uri(&sock))
        .arg(&copy)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("nbdcopy");
    write_pattern(&mut c, 2, 4 * MIB, 24 * MIB);
    let out = running.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "nbdcopy: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_file_is("nbdcopy of the export", &copy, &at_first);
    let full = dir.path().join("full.qcow2");
    nbd::convert_qcow2(&sock, &full);
    ctl_ok(&api, &["backup", "stop"]);

    // More changes, a write-zeroes among them (encrypted zeroes).
    let mut changed = vec![(4 * MIB, 24 * MIB)];
    for (i, (off, len)) in [(28 * MIB + 4 * KIB, 8 * KIB), (30 * MIB, 200 * KIB)]
        .into_iter()
        .enumerate()
    {
        assert_eq!(c.write(off, &pattern(10 + i as u64, off, len as usize)), 0);
        changed.push((off, len));
    }
    assert_eq!(c.write_zeroes(2 * MIB, 64 * KIB), 0);
    changed.push((2 * MIB, 64 * KIB));
    assert_eq!(c.flush(), 0);
    let at_second = plaintext("at-second.raw", size);

    let sock = backup_start(&api, &backups, "inc.sock", Some("inc"));
    // After the instant: in the live bitmap, not in the export.
    write_pattern(&mut c, 3, 0, MIB);
    assert_eq!(
        dirty(&sock, "inc"),
        granules(&changed, GRAN, size),
        "the incremental's map"
    );
    let top = dir.path().join("inc.qcow2");
    nbd::incremental(&sock, "inc", &full, &top);
    ctl_ok(&api, &["backup", "stop"]);
    let restored = dir.path().join("restored.raw");
    nbd::restore(&top, &restored);
    assert_file_is(
        "full + incremental, restored",
        &restored,
        &std::fs::read(&at_second).unwrap(),
    );
    drop(c);
    let mut d = d;
    let st = d.signal_and_wait(libc::SIGTERM, Duration::from_secs(20));
    assert!(st.success(), "the daemon exited with {st}:\n{}", d.log());
}

/// Two queues with many writes in flight (each queue's pool serving them
/// at once), then an online growth: QEMU reads everything back at the new
/// size.
#[test]
fn two_queues_deep_then_grown_online() {
    use ringblk_testkit::Op;
    let dir = test_dir();
    let img = qemu_img_luks(dir.path(), "mq.luks", 8 * MIB);
    let api = dir.path().join("api.sock");
    let mut d = serve(
        dir.path(),
        &img,
        &["--queues", "2", "--api", api.to_str().unwrap()],
    );
    let chunk = 64 * KIB as usize;
    let n = 64;
    let mut c = Client::connect_queues(&d.socket, n * chunk, 2);
    let mut written = Vec::new();
    let mut ops = Vec::new();
    for i in 0..n {
        // Every other 64 KiB of the 8 MiB.
        let off = (i * 2 * chunk) as u64;
        let data = pattern(10 + i as u64, off, chunk);
        c.buf()[i * chunk..(i + 1) * chunk].copy_from_slice(&data);
        ops.push((
            i % 2,
            Op::Write {
                offset: off,
                buf_off: i * chunk,
                len: chunk,
            },
        ));
        written.push((off, data));
    }
    assert!(c.batch_queues(&ops).iter().all(|&r| r == 0));
    assert_eq!(c.flush(), 0);
    drop(c);
    ringblk_testkit::ctl_ok(&api, &["resize", &(12 * MIB).to_string()]);
    let mut c = Client::connect(&d.socket, 1 << 20);
    assert_eq!(c.capacity, 12 * MIB);
    let tail = pattern(99, 11 * MIB, 512 * KIB as usize);
    assert_eq!(c.write(11 * MIB, &tail), 0);
    assert_eq!(c.flush(), 0);
    written.push((11 * MIB, tail));
    drop(c);
    d.signal_and_wait(libc::SIGTERM, Duration::from_secs(20));
    let plain = qemu_plaintext(dir.path(), &img);
    assert_eq!(plain.len() as u64, 12 * MIB, "QEMU sees the grown payload");
    assert_holds("qemu-img convert", &plain, &written);
}
