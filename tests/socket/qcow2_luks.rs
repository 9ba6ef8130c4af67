//! Encrypted qcow2 images as qemu-img makes them (`encrypt.format=luks`,
//! what libvirt and OpenStack create), served with `--format qcow2
//! --key-file`, with QEMU as the oracle: what ringblk wrote, `qemu-img
//! convert` reads back as the client's plaintext, over the whole disk
//! (clusters qemu-io wrote, clusters ringblk allocated, partial writes
//! whose copy-on-write must decrypt and encrypt again for the new host
//! offset, write-zeroes), and `qemu-img check` finds the image clean;
//! chains whose layers each have a LUKS header of their own, and a plain
//! overlay over an encrypted base. Without the passphrase, or with the
//! legacy AES method, refused with one line in any layer of a chain, and
//! left as they were.

use std::path::{Path, PathBuf};
use std::time::Duration;

use ringblk_testkit::luks::{PASS, key_file, qemu_img_create, qemu_img_qcow2_luks};
use ringblk_testkit::qemu_img::{check_with, run};
use ringblk_testkit::{Client, Daemon, DaemonOptions, KIB, MIB, pattern, serve_refused, test_dir};

/// `qemu-img create -f qcow2` with `opts` (an encryption), the secret
/// [`PASS`], `size` bytes.
fn encrypted(dir: &Path, name: &str, opts: &str, size: u64) -> PathBuf {
    let img = dir.join(name);
    let secret = format!("secret,id=s0,data={}", String::from_utf8_lossy(PASS));
    qemu_img_create(&[
        "create",
        "-f",
        "qcow2",
        "--object",
        &secret,
        "-o",
        opts,
        img.to_str().unwrap(),
        &size.to_string(),
    ]);
    img
}

/// Serves `image` (qcow2), expects a refusal; checks the image was not
/// written and returns the line.
fn refused(dir: &Path, image: &Path, extra: &[&str]) -> String {
    let before = std::fs::read(image).unwrap();
    let mut args = vec!["--image", image.to_str().unwrap(), "--format", "qcow2"];
    args.extend_from_slice(extra);
    let line = serve_refused(dir, &[], &args);
    assert!(
        std::fs::read(image).unwrap() == before,
        "{}: written by a refused open",
        image.display()
    );
    line
}

/// Without a passphrase an encrypted layer is refused (naming it), and
/// the legacy AES method always is.
#[test]
fn encrypted_qcow2_is_refused_in_any_layer() {
    let dir = test_dir();
    let d = dir.path();
    let luks = encrypted(
        d,
        "luks.qcow2",
        "encrypt.format=luks,encrypt.key-secret=s0,encrypt.iter-time=10",
        8 * MIB,
    );
    let line = refused(d, &luks, &[]);
    assert!(
        line.contains("luks.qcow2") && line.contains("encrypt.format=luks"),
        "{line}"
    );
    let aes = encrypted(
        d,
        "aes.qcow2",
        "encryption=on,encrypt.key-secret=s0",
        8 * MIB,
    );
    let line = refused(d, &aes, &[]);
    assert!(
        line.contains("aes.qcow2") && line.contains("legacy AES"),
        "{line}"
    );
    for (name, backing) in [("over-luks.qcow2", &luks), ("over-aes.qcow2", &aes)] {
        let top = d.join(name);
        ringblk_testkit::luks::qemu_img_create(&[
            "create",
            "-f",
            "qcow2",
            "-F",
            "qcow2",
            "-b",
            backing.to_str().unwrap(),
            top.to_str().unwrap(),
        ]);
        let line = refused(d, &top, &[]);
        let bname = backing.file_name().unwrap().to_str().unwrap();
        assert!(line.contains(bname) && line.contains("encrypt"), "{line}");
        let line = refused(d, &top, &["--readonly"]);
        assert!(line.contains(bname), "read-only too: {line}");
    }
}

/// The disk's size in these tests, and the clusters' (64 KiB, QEMU's
/// default).
const SIZE: u64 = 16 * MIB;
const CLUSTER: u64 = 64 * KIB;

/// An encrypted qcow2 of [`SIZE`] (LUKS, [`PASS`]), over `backing` (a
/// qcow2 file in the same directory) if given.
fn encrypted_over(dir: &Path, name: &str, backing: Option<&str>) -> PathBuf {
    let img = dir.join(name);
    let size = SIZE.to_string();
    let key = key_file(dir, PASS);
    qemu_img_qcow2_luks(&img, &key, backing.map(|b| (b, "qcow2")), Some(&size));
    img
}

/// QEMU's options for `img`, its encrypted layers (the top and the one
/// below, as `layers` says) opened with [`PASS`], and the secret's
/// object.
fn qemu_opts(dir: &Path, img: &Path, layers: (bool, bool)) -> (String, String) {
    let key = key_file(dir, PASS);
    let mut opts = format!("driver=qcow2,file.filename={}", img.display());
    if layers.0 {
        opts.push_str(",encrypt.key-secret=s0");
    }
    if layers.1 {
        opts.push_str(",backing.encrypt.key-secret=s0");
    }
    (format!("secret,id=s0,file={}", key.display()), opts)
}

/// The guest's disk of `img` (its encrypted layers as `layers` says), as
/// QEMU reads it: `qemu-img convert -O raw` with the passphrase.
fn qemu_plaintext(dir: &Path, img: &Path, layers: (bool, bool)) -> Vec<u8> {
    let (object, opts) = qemu_opts(dir, img, layers);
    ringblk_testkit::luks::qemu_convert(dir, &object, &opts)
}

/// Asserts `qemu-img check` of `img` (its encrypted layers as `layers`
/// says) finds no corruption and no leak.
#[track_caller]
fn check_clean(dir: &Path, img: &Path, layers: (bool, bool)) {
    let (object, opts) = qemu_opts(dir, img, layers);
    let found = check_with(&["--object", &object, "--image-opts", &opts]);
    assert_eq!(found, (0, 0), "{}: (corruptions, leaks)", img.display());
}

/// `qemu-io` on the encrypted `img`, which has no backing file, with
/// `cmds`.
fn qemu_io(dir: &Path, img: &Path, cmds: &[&str]) {
    let (object, opts) = qemu_opts(dir, img, (true, false));
    let mut args = vec!["--object", &object, "--image-opts", &opts];
    for c in cmds {
        args.extend(["-c", c]);
    }
    let out = run("qemu-io", &args);
    assert!(!out.contains("error") && !out.contains("failed"), "{out}");
}

/// Serves `img` (qcow2) with the key file for [`PASS`].
fn serve(dir: &Path, img: &Path) -> Daemon {
    serve_with(dir, img, &[])
}

/// [`serve`], with `extra` arguments.
fn serve_with(dir: &Path, img: &Path, extra: &[&str]) -> Daemon {
    let key = key_file(dir, PASS);
    let mut args = vec!["--format", "qcow2", "--key-file", key.to_str().unwrap()];
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

/// The guest's disk as the tests model it.
struct Model(Vec<u8>);

impl Model {
    fn write(&mut self, c: &mut Client, off: u64, data: &[u8]) {
        assert_eq!(c.write(off, data), 0, "write at {off}");
        self.0[off as usize..off as usize + data.len()].copy_from_slice(data);
    }

    fn zero(&mut self, c: &mut Client, off: u64, len: u64) {
        assert_eq!(c.write_zeroes(off, len), 0, "write-zeroes at {off}");
        self.0[off as usize..(off + len) as usize].fill(0);
    }

    /// Everything reads back through the daemon as modelled.
    fn read_back(&self, c: &mut Client) {
        let mut off = 0;
        while off < SIZE {
            let got = c.read(off, MIB as usize);
            assert_same(
                &format!("ringblk at {off}"),
                &got,
                &self.0[off as usize..][..MIB as usize],
                off,
            );
            off += MIB;
        }
    }
}

#[track_caller]
fn assert_same(what: &str, got: &[u8], want: &[u8], base: u64) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) {
        panic!("{what}: byte {} differs", base + i as u64);
    }
}

/// The writes every test makes, over clusters of every kind: inside a
/// cluster qemu-io wrote (the top's own, rewritten in place), a new
/// cluster whole, partial writes at the head, middle and tail of new
/// clusters (copy-on-write of what lies below), across a cluster
/// boundary, a write-zeroes of whole clusters with unaligned ends, and
/// the last sectors.
fn exercise(c: &mut Client, m: &mut Model) {
    let writes: [(u64, usize); 7] = [
        (4096, 8192),
        (2 * MIB, CLUSTER as usize),
        (3 * MIB, 4096),
        (4 * MIB + 20 * KIB, 8192),
        (5 * MIB + CLUSTER - 4096, 4096),
        (6 * MIB + CLUSTER - 512, 1024),
        (SIZE - 4096, 4096),
    ];
    for (i, (off, len)) in writes.into_iter().enumerate() {
        m.write(c, off, &pattern(100 + i as u64, off, len));
    }
    m.zero(c, 8 * MIB - 4096, 3 * CLUSTER);
    assert_eq!(c.flush(), 0);
}

/// Where qemu-io writes before ringblk serves the image: patterns 0xa1..
/// at 0, 1 MiB, 3 MiB and 5 MiB (a cluster's worth each), in every layer
/// it is asked for.
fn qemu_writes(dir: &Path, img: &Path, m: &mut Model, byte: u8) {
    let at = [0, MIB, 3 * MIB, 5 * MIB, 8 * MIB];
    let cmds: Vec<String> = at
        .iter()
        .map(|o| format!("write -P {byte:#x} {o} {CLUSTER}"))
        .collect();
    let cmds: Vec<&str> = cmds.iter().map(String::as_str).collect();
    qemu_io(dir, img, &cmds);
    for o in at {
        m.0[o as usize..(o + CLUSTER) as usize].fill(byte);
    }
}

/// One image: qemu-io's data read through ringblk, ringblk's writes read
/// by QEMU, both over the whole disk; clean by `qemu-img check`; again
/// after a restart.
#[test]
fn served_and_read_back_by_qemu() {
    let dir = test_dir();
    let d = dir.path();
    let img = encrypted_over(d, "enc.qcow2", None);
    let mut m = Model(vec![0u8; SIZE as usize]);
    qemu_writes(d, &img, &mut m, 0xa1);
    let mut daemon = serve(d, &img);
    let mut c = Client::connect(&daemon.socket, 2 << 20);
    assert_eq!(c.capacity, SIZE);
    m.read_back(&mut c);
    exercise(&mut c, &mut m);
    m.read_back(&mut c);
    drop(c);
    daemon.signal_and_wait(libc::SIGTERM, Duration::from_secs(20));
    check_clean(d, &img, (true, false));
    assert_same(
        "qemu-img convert",
        &qemu_plaintext(d, &img, (true, false)),
        &m.0,
        0,
    );
    // The clusters hold ciphertext: no pattern byte run of the client's
    // is in the file.
    let file = std::fs::read(&img).unwrap();
    let needle = pattern(101, 2 * MIB, 4096);
    assert!(
        !file
            .windows(needle.len())
            .step_by(512)
            .any(|w| w == &needle[..]),
        "the client's plaintext is in the file"
    );
    let daemon = serve(d, &img);
    let mut c = Client::connect(&daemon.socket, 2 << 20);
    m.read_back(&mut c);
}

/// A chain of two encrypted layers, each with its own LUKS header and
/// volume key (one passphrase): reads through to the base, partial writes
/// copied up from the base (decrypted with its key and IVs, encrypted
/// with the top's for the new place); and a plain overlay over an
/// encrypted base, whose copy-up is plaintext.
#[test]
fn chains_copy_up_through_each_layers_key() {
    let dir = test_dir();
    let d = dir.path();
    for plain_top in [false, true] {
        let mut m = Model(vec![0u8; SIZE as usize]);
        let base_name = format!("base-{plain_top}.qcow2");
        let base = encrypted_over(d, &base_name, None);
        qemu_writes(d, &base, &mut m, 0xb2);
        let top = if plain_top {
            let top = d.join("plain-top.qcow2");
            ringblk_testkit::qemu_img::create_qcow2(&top, "", Some((&base_name, "qcow2")), None);
            top
        } else {
            encrypted_over(d, "enc-top.qcow2", Some(&base_name))
        };
        let mut daemon = serve(d, &top);
        let mut c = Client::connect(&daemon.socket, 2 << 20);
        m.read_back(&mut c);
        exercise(&mut c, &mut m);
        // Partial writes into clusters only the base has.
        for (i, off) in [MIB + 4096, 3 * MIB + CLUSTER - 8192, 5 * MIB + 12 * KIB]
            .into_iter()
            .enumerate()
        {
            m.write(&mut c, off, &pattern(200 + i as u64, off, 4096));
        }
        assert_eq!(c.flush(), 0);
        m.read_back(&mut c);
        drop(c);
        daemon.signal_and_wait(libc::SIGTERM, Duration::from_secs(20));
        check_clean(d, &top, (!plain_top, true));
        check_clean(d, &base, (true, false));
        assert_same(
            &format!("qemu-img convert (plain top: {plain_top})"),
            &qemu_plaintext(d, &top, (!plain_top, true)),
            &m.0,
            0,
        );
    }
}

/// A wrong passphrase is one line naming the layer; nothing is written.
#[test]
fn a_wrong_passphrase_is_refused_in_one_line() {
    let dir = test_dir();
    let d = dir.path();
    let img = encrypted_over(d, "enc.qcow2", None);
    let key = key_file(d, b"not the passphrase");
    let line = refused(d, &img, &["--key-file", key.to_str().unwrap()]);
    assert!(
        line.contains("enc.qcow2") && line.contains("passphrase"),
        "{line}"
    );
}

/// A backup of an encrypted chain (an encrypted overlay over an
/// encrypted base) exports the guest's plaintext at the instant it
/// started: the guest overwrites clusters of both layers before nbdcopy
/// starts and while it copies, and their old data, which the
/// copy-before-write reads through the chain decrypted with each layer's
/// key, is what the export serves.
#[test]
fn a_backup_exports_the_plaintext_at_the_instant() {
    use ringblk_testkit::ctl_ok;
    use ringblk_testkit::nbd::{self, backup_start};
    if !nbd::have_tools() {
        return;
    }
    let dir = test_dir();
    let d = dir.path();
    let mut m = Model(vec![0u8; SIZE as usize]);
    let base = encrypted_over(d, "base.qcow2", None);
    qemu_writes(d, &base, &mut m, 0xc3);
    let top = encrypted_over(d, "top.qcow2", Some("base.qcow2"));
    let api = d.join("api.sock");
    let backups = d.join("backups");
    std::fs::create_dir(&backups).unwrap();
    let mut daemon = serve_with(
        d,
        &top,
        &[
            "--api",
            api.to_str().unwrap(),
            "--backup-dir",
            backups.to_str().unwrap(),
        ],
    );
    let mut c = Client::connect(&daemon.socket, 2 << 20);
    exercise(&mut c, &mut m);
    let at_start = m.0.clone();
    let sock = backup_start(&api, &backups, "full.sock", None);
    // Over the base's clusters, the top's, and never-written ones: half
    // before the copy starts (their old data must come from the
    // copy-before-write), half while it runs.
    let overwrite = |c: &mut Client, m: &mut Model, half: u64| {
        for (i, off) in (half * SIZE / 2..(half + 1) * SIZE / 2)
            .step_by(MIB as usize)
            .enumerate()
        {
            let data = pattern(300 + half * 100 + i as u64, off + 4096, 64 * KIB as usize);
            m.write(c, off + 4096, &data);
        }
    };
    overwrite(&mut c, &mut m, 0);
    let copy = d.join("copy.raw");
    let running = std::process::Command::new("nbdcopy")
        .arg(nbd::uri(&sock))
        .arg(&copy)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("nbdcopy");
    overwrite(&mut c, &mut m, 1);
    let out = running.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "nbdcopy: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_same("the export", &std::fs::read(&copy).unwrap(), &at_start, 0);
    ctl_ok(&api, &["backup", "stop"]);
    m.read_back(&mut c);
    drop(c);
    daemon.signal_and_wait(libc::SIGTERM, Duration::from_secs(20));
    assert_same(
        "qemu-img convert",
        &qemu_plaintext(d, &top, (true, true)),
        &m.0,
        0,
    );
}

/// Two queues with 64 writes in flight, each across a cluster boundary
/// (two pieces, allocated and encrypted for their places at once), over
/// an encrypted base; then an online growth and a write past the old
/// end: QEMU reads the whole grown disk as the client wrote it.
#[test]
fn two_queues_deep_across_clusters_then_grown_online() {
    use ringblk_testkit::Op;
    let dir = test_dir();
    let d = dir.path();
    let mut m = Model(vec![0u8; SIZE as usize]);
    let base = encrypted_over(d, "base.qcow2", None);
    qemu_writes(d, &base, &mut m, 0xd4);
    let top = encrypted_over(d, "top.qcow2", Some("base.qcow2"));
    let api = d.join("api.sock");
    let mut daemon = serve_with(d, &top, &["--queues", "2", "--api", api.to_str().unwrap()]);
    let chunk = CLUSTER as usize;
    let n = 64;
    let mut c = Client::connect_queues(&daemon.socket, n * chunk, 2);
    let mut ops = Vec::new();
    for i in 0..n {
        // Every other cluster's second half and the next one's first.
        let off = i as u64 * 4 * CLUSTER + CLUSTER / 2;
        let data = pattern(500 + i as u64, off, chunk);
        c.buf()[i * chunk..(i + 1) * chunk].copy_from_slice(&data);
        m.0[off as usize..off as usize + chunk].copy_from_slice(&data);
        ops.push((
            i % 2,
            Op::Write {
                offset: off,
                buf_off: i * chunk,
                len: chunk,
            },
        ));
    }
    assert!(c.batch_queues(&ops).iter().all(|&r| r == 0));
    assert_eq!(c.flush(), 0);
    drop(c);
    let grown = SIZE + 8 * MIB;
    ringblk_testkit::ctl_ok(&api, &["resize", &grown.to_string()]);
    let mut c = Client::connect(&daemon.socket, 2 << 20);
    assert_eq!(c.capacity, grown);
    m.0.resize(grown as usize, 0);
    let off = grown - MIB - 4096;
    m.write(&mut c, off, &pattern(600, off, (MIB / 2) as usize));
    assert_eq!(c.flush(), 0);
    drop(c);
    daemon.signal_and_wait(libc::SIGTERM, Duration::from_secs(20));
    check_clean(d, &top, (true, true));
    let plain = qemu_plaintext(d, &top, (true, true));
    assert_eq!(plain.len() as u64, grown, "QEMU sees the grown disk");
    assert_same("qemu-img convert", &plain, &m.0, 0);
}

/// A live snapshot of an encrypted qcow2: the overlay is encrypted too
/// (the top's LUKS header copied into it, so the one passphrase opens
/// it), the guest's writes after the snapshot land in it as ciphertext,
/// and QEMU, given the secret for both layers, finds the new chain clean
/// and reads what the client wrote before and after.
#[test]
fn a_live_snapshot_of_an_encrypted_top_is_encrypted() {
    use ringblk_testkit::ctl_ok;
    let dir = test_dir();
    let d = dir.path();
    let mut m = Model(vec![0u8; SIZE as usize]);
    let img = encrypted_over(d, "enc.qcow2", None);
    qemu_writes(d, &img, &mut m, 0xe5);
    let api = d.join("api.sock");
    let snaps = d.join("snaps");
    std::fs::create_dir(&snaps).unwrap();
    let mut daemon = serve_with(
        d,
        &img,
        &[
            "--api",
            api.to_str().unwrap(),
            "--snapshot-dir",
            snaps.to_str().unwrap(),
        ],
    );
    let mut c = Client::connect(&daemon.socket, 2 << 20);
    exercise(&mut c, &mut m);
    let at_snapshot = m.0.clone();
    ctl_ok(&api, &["snapshot", "--overlay", "s1.qcow2"]);
    let s1 = snaps.join("s1.qcow2");
    // After the snapshot: in place over the old top's clusters (copied
    // up), new clusters, partial ones.
    for (i, off) in [4096, 2 * MIB + 8192, 9 * MIB, 12 * MIB + 1024]
        .into_iter()
        .enumerate()
    {
        m.write(
            &mut c,
            off,
            &pattern(700 + i as u64, off, 12 * KIB as usize),
        );
    }
    assert_eq!(c.flush(), 0);
    m.read_back(&mut c);
    drop(c);
    daemon.signal_and_wait(libc::SIGTERM, Duration::from_secs(20));
    check_clean(d, &s1, (true, true));
    check_clean(d, &img, (true, false));
    assert_same(
        "qemu-img convert of the new chain",
        &qemu_plaintext(d, &s1, (true, true)),
        &m.0,
        0,
    );
    assert_same(
        "qemu-img convert of the frozen top",
        &qemu_plaintext(d, &img, (true, false)),
        &at_snapshot,
        0,
    );
    let file = std::fs::read(&s1).unwrap();
    let needle = pattern(700, 4096, 4096);
    assert!(
        !file
            .windows(needle.len())
            .step_by(512)
            .any(|w| w == &needle[..]),
        "the client's plaintext is in the overlay"
    );
}

/// kill -9 after flushed allocating writes (and more in flight, not
/// flushed): `qemu-img check` with the secret finds the image clean right
/// after, QEMU reads every flushed write, and a restarted daemon (which
/// writes its L2 log in) reads them too and checks clean after it stops.
#[test]
fn a_kill_9_loses_no_flushed_write() {
    let dir = test_dir();
    let d = dir.path();
    let mut m = Model(vec![0u8; SIZE as usize]);
    let img = encrypted_over(d, "enc.qcow2", None);
    qemu_writes(d, &img, &mut m, 0xf6);
    let mut daemon = serve(d, &img);
    let mut c = Client::connect(&daemon.socket, 2 << 20);
    exercise(&mut c, &mut m);
    let flushed = m.0.clone();
    // After the flush: overwritten or not by the kill, either is right.
    for i in 0..8u64 {
        let off = 10 * MIB + i * CLUSTER + 4096;
        assert_eq!(c.write(off, &pattern(800 + i, off, 4096)), 0);
    }
    daemon.signal_and_wait(libc::SIGKILL, Duration::from_secs(20));
    drop(c);
    check_clean(d, &img, (true, false));
    let after_kill = qemu_plaintext(d, &img, (true, false));
    let unflushed = (10 * MIB) as usize..(10 * MIB + 8 * CLUSTER) as usize;
    assert_same(
        "qemu-img convert right after kill -9, outside the unflushed writes",
        &outside_at(&after_kill, 0, &unflushed),
        &outside_at(&flushed, 0, &unflushed),
        0,
    );
    let mut daemon = serve(d, &img);
    let mut c = Client::connect(&daemon.socket, 2 << 20);
    let mut off = 0;
    while off < SIZE {
        let got = outside_at(&c.read(off, MIB as usize), off, &unflushed);
        let want = outside_at(&flushed[off as usize..][..MIB as usize], off, &unflushed);
        assert_same(
            &format!("ringblk after the restart, at {off}"),
            &got,
            &want,
            off,
        );
        off += MIB;
    }
    drop(c);
    daemon.signal_and_wait(libc::SIGTERM, Duration::from_secs(20));
    check_clean(d, &img, (true, false));
}

/// `buf`, read at guest byte `off`, with the bytes inside `hole` zeroed.
fn outside_at(buf: &[u8], off: u64, hole: &std::ops::Range<usize>) -> Vec<u8> {
    let mut v = buf.to_vec();
    let (start, end) = (off as usize, off as usize + buf.len());
    let (a, b) = (hole.start.max(start), hole.end.min(end));
    if a < b {
        v[a - start..b - start].fill(0);
    }
    v
}

/// A stream on an encrypted chain (an encrypted top, a live snapshot of
/// it, writes in both): every layer below the top copied up, decrypted
/// with the key of the layer it lay in and encrypted for the top; the top
/// then stands alone. QEMU, given the secret for the top only, finds it
/// clean, reads what the client wrote, and the client's plaintext is not
/// in the file.
#[test]
fn a_stream_of_an_encrypted_chain_stays_encrypted() {
    use ringblk_testkit::ctl_ok;
    let dir = test_dir();
    let d = dir.path();
    let mut m = Model(vec![0u8; SIZE as usize]);
    let img = encrypted_over(d, "enc.qcow2", None);
    qemu_writes(d, &img, &mut m, 0xe6);
    let api = d.join("api.sock");
    let snaps = d.join("snaps");
    std::fs::create_dir(&snaps).unwrap();
    let mut daemon = serve_with(
        d,
        &img,
        &[
            "--api",
            api.to_str().unwrap(),
            "--snapshot-dir",
            snaps.to_str().unwrap(),
        ],
    );
    let mut c = Client::connect(&daemon.socket, 2 << 20);
    exercise(&mut c, &mut m);
    ctl_ok(&api, &["snapshot", "--overlay", "s1.qcow2"]);
    let s1 = snaps.join("s1.qcow2");
    m.write(&mut c, 3 * MIB + 4096, &pattern(800, 3 * MIB + 4096, 8192));
    assert_eq!(c.flush(), 0);
    ctl_ok(&api, &["stream"]);
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let out = ringblk_testkit::ctl(&api, &["job", "status"]);
        let job: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        if job["state"] != "running" {
            assert_eq!(job["state"], "completed", "{job}");
            break;
        }
        assert!(std::time::Instant::now() < deadline, "the stream runs on");
        std::thread::sleep(Duration::from_millis(20));
    }
    m.read_back(&mut c);
    drop(c);
    daemon.signal_and_wait(libc::SIGTERM, Duration::from_secs(20));
    // The top alone: no secret needed for a layer below it.
    check_clean(d, &s1, (true, false));
    assert_same(
        "qemu-img convert of the streamed top",
        &qemu_plaintext(d, &s1, (true, false)),
        &m.0,
        0,
    );
    let file = std::fs::read(&s1).unwrap();
    for (what, needle) in [
        ("qemu-io's", vec![0xe6u8; 4096]),
        ("the client's", pattern(100, 4096, 4096)),
    ] {
        assert!(
            !file
                .windows(needle.len())
                .step_by(512)
                .any(|w| w == &needle[..]),
            "{what} plaintext is in the streamed top"
        );
    }
}

/// An active commit of an encrypted chain: a live snapshot's overlay (as
/// encrypted as the image below it) committed back into the image while
/// the client writes, then the pivot. What the client wrote before, during
/// and after lands in the image encrypted: QEMU, given its secret, finds it
/// clean and reads the client's data, and the client's plaintext is not in
/// the file.
#[test]
fn an_active_commit_of_an_encrypted_chain_stays_encrypted() {
    use ringblk_testkit::ctl_ok;
    let dir = test_dir();
    let d = dir.path();
    let mut m = Model(vec![0u8; SIZE as usize]);
    let img = encrypted_over(d, "enc.qcow2", None);
    qemu_writes(d, &img, &mut m, 0xe6);
    let api = d.join("api.sock");
    let snaps = d.join("snaps");
    std::fs::create_dir(&snaps).unwrap();
    let mut daemon = serve_with(
        d,
        &img,
        &[
            "--api",
            api.to_str().unwrap(),
            "--snapshot-dir",
            snaps.to_str().unwrap(),
        ],
    );
    let mut c = Client::connect(&daemon.socket, 2 << 20);
    exercise(&mut c, &mut m);
    ctl_ok(&api, &["snapshot", "--overlay", "s1.qcow2"]);
    let s1 = snaps.join("s1.qcow2");
    m.write(&mut c, 3 * MIB + 4096, &pattern(800, 3 * MIB + 4096, 8192));
    assert_eq!(c.flush(), 0);
    let s1_name = std::fs::canonicalize(&s1).unwrap();
    ctl_ok(
        &api,
        &[
            "commit",
            "--top",
            s1_name.to_str().unwrap(),
            "--speed",
            "256K",
        ],
    );
    m.write(&mut c, 5 * MIB, &pattern(810, 5 * MIB, 65536));
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let out = ringblk_testkit::ctl(&api, &["job", "status"]);
        let job: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        if job["state"] != "running" {
            assert_eq!(job["state"], "completed", "{job}");
            assert_eq!(job["active"], true, "{job}");
            break;
        }
        assert!(std::time::Instant::now() < deadline, "the commit runs on");
        std::thread::sleep(Duration::from_millis(20));
    }
    m.write(&mut c, 7 * MIB, &pattern(820, 7 * MIB, 65536));
    assert_eq!(c.flush(), 0);
    m.read_back(&mut c);
    drop(c);
    daemon.signal_and_wait(libc::SIGTERM, Duration::from_secs(20));
    check_clean(d, &img, (true, false));
    assert_same(
        "qemu-img convert of the image the commit pivoted to",
        &qemu_plaintext(d, &img, (true, false)),
        &m.0,
        0,
    );
    let file = std::fs::read(&img).unwrap();
    for (when, needle) in [
        ("before the snapshot", pattern(100, 4096, 4096)),
        ("during the commit", pattern(810, 5 * MIB, 4096)),
        ("after the pivot", pattern(820, 7 * MIB, 4096)),
    ] {
        assert!(
            !file
                .windows(needle.len())
                .step_by(512)
                .any(|w| w == &needle[..]),
            "the client's plaintext written {when} is in the image"
        );
    }
}
