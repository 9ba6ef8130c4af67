//! `serve --format qcow2` through libblkio, with qemu-img as the oracle:
//! overlays over raw, qcow2 and compressed bases, many queues allocating
//! at once, discard and write-zeroes, online growth, live snapshots over
//! the control API, and bad images.
//!
//! Each test keeps a raw reference of what the guest's disk must read,
//! applies every request to it too, and at the end (the daemon stopped)
//! asserts: the base is unchanged (checksum), `qemu-img check` finds no
//! corruption, and `qemu-img compare` finds the overlay identical to the
//! reference.

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use ringblk_testkit::qemu_img::{check_clean, compare_identical, overlay, qemu_img, sha256};
use ringblk_testkit::{Client, Daemon, DaemonOptions, KIB, MIB, Op, ctl, test_dir};

pub(crate) const SIZE: u64 = 32 * MIB;
pub(crate) const CLUSTER: u64 = 64 * KIB;

/// A deterministic byte for `offset` of pattern `seed` (0: the base's).
fn byte(seed: u64, offset: u64) -> u8 {
    let x =
        (offset / 8).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ seed.wrapping_mul(0xc2b2_ae3d_27d4_eb4f);
    (x >> ((offset % 8) * 8)) as u8 ^ (x >> 56) as u8
}

pub(crate) fn fill(seed: u64, offset: u64, buf: &mut [u8]) {
    for (i, b) in buf.iter_mut().enumerate() {
        *b = byte(seed, offset + i as u64);
    }
}

/// A small xorshift generator: tests are reproducible from their seed.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x % n
    }
}

/// A base of `kind` ("raw", "qcow2", "compressed") holding pattern 0, an
/// overlay over it, and a raw reference of what the overlay reads (a copy
/// of the base's content), all in `dir`.
pub(crate) struct Chain {
    pub(crate) base: PathBuf,
    pub(crate) top: PathBuf,
    pub(crate) reference: PathBuf,
    base_sum: String,
}

pub(crate) fn chain(dir: &Path, kind: &str, size: u64) -> Chain {
    let reference = dir.join("reference.raw");
    let mut data = vec![0u8; size as usize];
    fill(0, 0, &mut data);
    std::fs::write(&reference, &data).unwrap();
    let (base, fmt) = match kind {
        "raw" => {
            let b = dir.join("base.raw");
            std::fs::copy(&reference, &b).unwrap();
            (b, "raw")
        }
        "qcow2" | "compressed" => {
            let b = dir.join("base.qcow2");
            let mut args = vec!["convert", "-O", "qcow2"];
            if kind == "compressed" {
                args.push("-c");
            }
            args.extend([reference.to_str().unwrap(), b.to_str().unwrap()]);
            qemu_img(&args);
            (b, "qcow2")
        }
        other => panic!("{other}"),
    };
    let top = dir.join("top.qcow2");
    overlay(&base, fmt, &top);
    Chain {
        base_sum: sha256(&base),
        base,
        top,
        reference,
    }
}

impl Chain {
    /// Applies a write of pattern `seed` to the reference.
    pub(crate) fn write(&self, seed: u64, offset: u64, len: usize) -> Vec<u8> {
        let mut buf = vec![0u8; len];
        fill(seed, offset, &mut buf);
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&self.reference)
            .unwrap();
        f.write_all_at(&buf, offset).unwrap();
        buf
    }

    fn zero(&self, offset: u64, len: u64) {
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&self.reference)
            .unwrap();
        f.write_all_at(&vec![0u8; len as usize], offset).unwrap();
    }

    pub(crate) fn expected(&self, offset: u64, len: usize) -> Vec<u8> {
        let mut buf = vec![0u8; len];
        std::fs::File::open(&self.reference)
            .unwrap()
            .read_exact_at(&mut buf, offset)
            .unwrap();
        buf
    }

    /// The oracle's verdict, the daemon stopped: the base unchanged, no
    /// corruption, the overlay reads as the reference. Returns the leaked
    /// clusters.
    fn verify(&self) -> u64 {
        assert_eq!(sha256(&self.base), self.base_sum, "the base was written");
        let leaks = check_clean(&self.top);
        compare_identical(&self.top, &self.reference);
        leaks
    }
}

pub(crate) fn serve(c: &Chain, dir: &Path, args: &[&str]) -> Daemon {
    let mut all = vec!["--format", "qcow2"];
    all.extend_from_slice(args);
    Daemon::start_in(
        dir,
        DaemonOptions {
            image: Some(c.top.clone()),
            args: &all,
            ..DaemonOptions::default()
        },
    )
}

pub(crate) fn stop(mut d: Daemon) {
    let st = d.signal_and_wait(libc::SIGTERM, Duration::from_secs(20));
    assert!(st.success(), "the daemon exited with {st}:\n{}", d.log());
}

/// Writes and reads through `client` what `chain` records, unaligned and
/// across clusters, and checks every read against the reference.
fn exercise(client: &mut Client, c: &Chain) {
    let check = |client: &mut Client, offset: u64, len: usize| {
        let got = client.read(offset, len);
        assert!(
            got == c.expected(offset, len),
            "read of {len} bytes at {offset} differs from the reference"
        );
    };
    // The base shows through.
    check(client, 0, 256 * KIB as usize);
    check(client, SIZE - 64 * KIB, 64 * KIB as usize);
    let writes: &[(u64, usize)] = &[
        // Inside one cluster, copy-on-write around it.
        (4 * KIB, 8 * KIB as usize),
        // Across two clusters.
        (CLUSTER - 4 * KIB, 12 * KIB as usize),
        // A whole cluster.
        (3 * CLUSTER, CLUSTER as usize),
        // Large, unaligned, over many clusters.
        (10 * CLUSTER + 512, (MIB + 1024) as usize),
        // Again over a cluster written before.
        (6 * KIB, 4 * KIB as usize),
        // The last sector.
        (SIZE - 512, 512),
    ];
    for (i, &(offset, len)) in writes.iter().enumerate() {
        let data = c.write(i as u64 + 1, offset, len);
        assert_eq!(client.write(offset, &data), 0, "write at {offset}");
        let from = offset.saturating_sub(4 * KIB);
        let to = (offset + len as u64 + 4 * KIB).min(SIZE);
        check(client, from, (to - from) as usize);
    }
    // Write-zeroes: whole clusters and an unaligned head and tail.
    let (zo, zl) = (20 * CLUSTER + 4 * KIB, 3 * CLUSTER);
    assert_eq!(client.write_zeroes(zo, zl), 0);
    c.zero(zo, zl);
    check(client, 20 * CLUSTER, 4 * CLUSTER as usize);
    // Discard of written clusters: what it leaves is unspecified, so the
    // range is written again afterwards (and must read back).
    assert_eq!(client.discard(10 * CLUSTER, 4 * CLUSTER), 0);
    let data = c.write(99, 10 * CLUSTER, 4 * CLUSTER as usize);
    assert_eq!(client.write(10 * CLUSTER, &data), 0);
    check(client, 10 * CLUSTER, 4 * CLUSTER as usize);
    assert_eq!(client.flush(), 0);
}

/// Writes over an overlay of each kind of base read back right, and the
/// image is what qemu-img expects: base unchanged, check clean, compare
/// identical.
#[test]
fn an_overlay_over_each_kind_of_base_reads_and_writes() {
    for kind in ["raw", "qcow2", "compressed"] {
        let dir = test_dir();
        let c = chain(dir.path(), kind, SIZE);
        let d = serve(&c, dir.path(), &[]);
        let mut client = Client::connect(&d.socket, 2 * MIB as usize);
        assert_eq!(client.capacity, SIZE);
        exercise(&mut client, &c);
        drop(client);
        stop(d);
        let leaks = c.verify();
        assert_eq!(leaks, 0, "{kind}: leaked clusters");
    }
}

/// The same with O_DIRECT data I/O.
#[test]
fn an_overlay_served_with_o_direct() {
    let dir = test_dir();
    let c = chain(dir.path(), "qcow2", SIZE);
    let d = serve(&c, dir.path(), &["--direct"]);
    let mut client = Client::connect(&d.socket, 2 * MIB as usize);
    exercise(&mut client, &c);
    drop(client);
    stop(d);
    c.verify();
}

/// A connection starts with an empty mapping cache: writes into clusters
/// the overlay has already miss it, one after another (depth 1), and are
/// resolved at once on the queue's own thread; each completes (its data
/// I/O submitted in the same pass), and they read back.
#[test]
fn writes_after_a_reconnect_miss_the_cache_and_complete() {
    let dir = test_dir();
    let c = chain(dir.path(), "qcow2", SIZE);
    let d = serve(&c, dir.path(), &[]);
    let at = |i: u64, within: u64| 3 * i * CLUSTER + within;
    let mut client = Client::connect(&d.socket, 2 * MIB as usize);
    for i in 0..8 {
        let data = c.write(i + 1, at(i, 4 * KIB), 4 * KIB as usize);
        assert_eq!(client.write(at(i, 4 * KIB), &data), 0);
    }
    drop(client);
    let mut client = Client::connect(&d.socket, 2 * MIB as usize);
    for i in 0..8 {
        let data = c.write(i + 11, at(i, 12 * KIB), 4 * KIB as usize);
        assert_eq!(client.write(at(i, 12 * KIB), &data), 0);
        assert!(
            client.read(at(i, 0), CLUSTER as usize) == c.expected(at(i, 0), CLUSTER as usize),
            "cluster {i} differs from the reference"
        );
    }
    assert_eq!(client.flush(), 0);
    drop(client);
    stop(d);
    c.verify();
}

/// 1, 2, 8 and 64 queues write random 4 KiB blocks of an empty overlay at
/// once, most of them allocating (copy-on-write from the base): every
/// block reads back, and the image checks clean.
#[test]
fn many_queues_allocate_at_once() {
    for queues in [1usize, 2, 8, 64] {
        let dir = test_dir();
        let c = chain(dir.path(), "qcow2", SIZE);
        let q = queues.to_string();
        let d = serve(&c, dir.path(), &["--queues", &q]);
        let per_queue = 16;
        let block = 4 * KIB as usize;
        let buf = (queues * per_queue * block).max(MIB as usize);
        let mut client = Client::connect_queues(&d.socket, buf, queues);
        let mut rng = Rng(0x5eed + queues as u64);
        let mut ops = Vec::new();
        let mut seen = std::collections::HashSet::new();
        for round in 0..4u64 {
            ops.clear();
            for i in 0..queues * per_queue {
                // Distinct blocks within a round: concurrent writes to one
                // block would have no defined result.
                let offset = loop {
                    let o = rng.below(SIZE / block as u64) * block as u64;
                    if seen.insert((round, o)) {
                        break o;
                    }
                };
                let data = c.write(round * 10_000 + i as u64, offset, block);
                client.buf()[i * block..(i + 1) * block].copy_from_slice(&data);
                ops.push((
                    i % queues,
                    Op::Write {
                        offset,
                        buf_off: i * block,
                        len: block,
                    },
                ));
            }
            let results = client.batch_queues(&ops);
            assert!(
                results.iter().all(|&r| r == 0),
                "{queues} queues: writes failed: {results:?}"
            );
        }
        assert_eq!(client.flush(), 0);
        // Everything reads back through the daemon too.
        for offset in (0..SIZE).step_by(MIB as usize) {
            let got = client.read(offset, MIB as usize);
            assert!(
                got == c.expected(offset, MIB as usize),
                "{queues} queues: MiB at {offset} differs"
            );
        }
        drop(client);
        stop(d);
        c.verify();
    }
}

/// `qemu-img convert` of `image` to a raw file next to it.
fn to_raw(image: &Path) -> PathBuf {
    let raw = image.with_extension("converted.raw");
    qemu_img(&[
        "convert",
        "-O",
        "raw",
        image.to_str().unwrap(),
        raw.to_str().unwrap(),
    ]);
    raw
}

/// A live snapshot between two sets of writes: the old top reads as the
/// disk did at the snapshot and is never written again; the new chain
/// reads as the disk does at the end; both check clean; `ctl status`
/// shows the chain.
#[test]
fn a_live_snapshot_freezes_the_old_top() {
    let dir = test_dir();
    let c = chain(dir.path(), "raw", SIZE);
    let api = dir.path().join("api.sock");
    let snaps = dir.path().join("snaps");
    std::fs::create_dir(&snaps).unwrap();
    let d = serve(
        &c,
        dir.path(),
        &[
            "--api",
            api.to_str().unwrap(),
            "--snapshot-dir",
            snaps.to_str().unwrap(),
        ],
    );
    let mut client = Client::connect(&d.socket, 2 * MIB as usize);
    for i in 0..8u64 {
        let data = c.write(i + 1, i * 3 * CLUSTER + 512, 20 * KIB as usize);
        assert_eq!(client.write(i * 3 * CLUSTER + 512, &data), 0);
    }
    let at_snapshot = dir.path().join("at-snapshot.raw");
    std::fs::copy(&c.reference, &at_snapshot).unwrap();
    let out = ctl(&api, &["snapshot", "--overlay", "s1.qcow2"]);
    assert!(
        out.status.success(),
        "ctl snapshot: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("s1.qcow2"), "{stdout}");
    let old_sum = sha256(&c.top);
    // Writes after the snapshot: over clusters the old top has, and new.
    for i in 0..8u64 {
        let data = c.write(100 + i, i * 2 * CLUSTER + 4 * KIB, 40 * KIB as usize);
        assert_eq!(client.write(i * 2 * CLUSTER + 4 * KIB, &data), 0);
    }
    exercise(&mut client, &c);
    let status = ctl(&api, &["status"]);
    let status: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    let chain: Vec<&str> = status["chain"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    let s1 = std::fs::canonicalize(snaps.join("s1.qcow2")).unwrap();
    assert_eq!(
        chain,
        [
            s1.to_str().unwrap(),
            std::fs::canonicalize(&c.top).unwrap().to_str().unwrap(),
            std::fs::canonicalize(&c.base).unwrap().to_str().unwrap(),
        ]
    );
    // A second snapshot of the same name is refused; the daemon goes on.
    let again = ctl(&api, &["snapshot", "--overlay", "s1.qcow2"]);
    assert_eq!(again.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&again.stderr).contains("exists"));
    // Outside the snapshot directory: refused.
    let outside = ctl(
        &api,
        &[
            "snapshot",
            "--overlay",
            dir.path().join("s2.qcow2").to_str().unwrap(),
        ],
    );
    assert_eq!(outside.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&outside.stderr).contains("snapshot directory"));
    assert_eq!(client.flush(), 0);
    drop(client);
    stop(d);
    assert_eq!(
        sha256(&c.top),
        old_sum,
        "the old top was written after the snapshot"
    );
    assert_eq!(sha256(&c.base), c.base_sum);
    check_clean(&c.top);
    compare_identical(&c.top, &at_snapshot);
    check_clean(&s1);
    compare_identical(&s1, &c.reference);
}

/// A snapshot while 8 queues write, round after round: every request
/// completes, the new chain reads as the last round made it, and the old
/// top holds each block as one round (or none) wrote it, whole: nothing
/// that completed on the new top reached it, and nothing was lost.
#[test]
fn a_live_snapshot_under_writes_loses_nothing() {
    let dir = test_dir();
    let c = chain(dir.path(), "qcow2", SIZE);
    let api = dir.path().join("api.sock");
    let d = serve(
        &c,
        dir.path(),
        &[
            "--queues",
            "8",
            "--api",
            api.to_str().unwrap(),
            "--snapshot-dir",
            dir.path().to_str().unwrap(),
        ],
    );
    let block = CLUSTER as usize;
    let blocks = (SIZE / CLUSTER) as usize;
    let mut client = Client::connect_queues(&d.socket, blocks * block, 8);
    let seed = |round: u64, i: usize| round * 1000 + i as u64 + 7;
    // The snapshot comes while the second round's writes are in flight.
    let writing = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let (api2, writing2) = (api.clone(), writing.clone());
    let snap = std::thread::spawn(move || {
        while writing2.load(std::sync::atomic::Ordering::SeqCst) < 2 {
            std::thread::sleep(Duration::from_millis(1));
        }
        std::thread::sleep(Duration::from_millis(5));
        ctl(&api2, &["snapshot", "--overlay", "s1.qcow2"])
    });
    let mut rounds = 0u64;
    let mut after_snapshot = 0;
    while after_snapshot < 2 {
        let mut ops = Vec::new();
        for i in 0..blocks {
            let offset = i as u64 * CLUSTER;
            let data = c.write(seed(rounds, i), offset, block);
            client.buf()[i * block..(i + 1) * block].copy_from_slice(&data);
            ops.push((
                i % 8,
                Op::Write {
                    offset,
                    buf_off: i * block,
                    len: block,
                },
            ));
        }
        writing.store(rounds + 1, std::sync::atomic::Ordering::SeqCst);
        let results = client.batch_queues(&ops);
        assert!(
            results.iter().all(|&r| r == 0),
            "round {rounds}: {results:?}"
        );
        rounds += 1;
        if snap.is_finished() {
            after_snapshot += 1;
        }
    }
    let out = snap.join().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(client.flush(), 0);
    drop(client);
    stop(d);
    let s1 = dir.path().join("s1.qcow2");
    check_clean(&c.top);
    check_clean(&s1);
    compare_identical(&s1, &c.reference);
    let old = std::fs::read(to_raw(&c.top)).unwrap();
    let mut by_round = vec![0usize; rounds as usize + 1];
    for i in 0..blocks {
        let offset = i as u64 * CLUSTER;
        let got = &old[i * block..(i + 1) * block];
        let mut want = vec![0u8; block];
        let found = (0..rounds).rev().find(|&r| {
            fill(seed(r, i), offset, &mut want);
            got == want
        });
        match found {
            Some(r) => by_round[r as usize + 1] += 1,
            None => {
                fill(0, offset, &mut want);
                assert!(got == want, "block {i} of the old top is no round's");
                by_round[0] += 1;
            }
        }
    }
    eprintln!("{rounds} rounds; blocks of the old top by round (none first): {by_round:?}");
}

/// Starts `serve --format qcow2` on `image` and expects a refusal: exit
/// status 1 within 20 s, one `ringblk:` line saying `what`, no panic.
fn refused(dir: &Path, image: &Path, what: &str) {
    refused_with(dir, image, &[], what)
}

/// [`refused`], with `args` added to the command line.
fn refused_with(dir: &Path, image: &Path, args: &[&str], what: &str) {
    let mut child = std::process::Command::new(ringblk_testkit::ringblk_bin())
        .args(["serve", "--format", "qcow2", "--socket"])
        .arg(dir.join("refused.sock"))
        .arg("--image")
        .arg(image)
        .args(args)
        .env("TMPDIR", dir)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("running ringblk serve");
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while child.try_wait().unwrap().is_none() {
        if std::time::Instant::now() > deadline {
            child.kill().unwrap();
            let out = child.wait_with_output().unwrap();
            panic!(
                "{}: the daemon started instead of refusing:\n{}",
                image.display(),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{}: {err}", image.display());
    assert!(!err.contains("panicked"), "{err}");
    let lines: Vec<&str> = err.lines().filter(|l| l.starts_with("ringblk: ")).collect();
    assert_eq!(lines.len(), 1, "not one error line:\n{err}");
    assert!(
        lines[0].to_lowercase().contains(&what.to_lowercase()),
        "{}: {:?} does not say {what:?}",
        image.display(),
        lines[0]
    );
}

/// Each kind of bad image through the daemon: a corrupt header, L1 and
/// refcount tables past the end of the file, overlapping metadata, an
/// absurd virtual size, unknown incompatible feature bits, a backing loop
/// and a chain deeper than the bound are refused at start with one line
/// and exit status 1. An L2 entry past the end of the file fails the
/// requests that touch it with IOERR, and the daemon keeps serving the
/// rest. The images are qemu-img's, with bytes patched.
#[test]
fn bad_images_are_refused_or_fail_their_requests() {
    let dir = test_dir();
    let d = dir.path();
    let good = d.join("good.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", good.to_str().unwrap(), "4M"]);
    ringblk_testkit::qemu_img::run(
        "qemu-io",
        &[
            "-f",
            "qcow2",
            "-c",
            "write -P 1 0 64k",
            good.to_str().unwrap(),
        ],
    );
    let bytes = std::fs::read(&good).unwrap();
    let be64 = |b: &[u8], at: usize| u64::from_be_bytes(b[at..at + 8].try_into().unwrap());
    let l1_off = be64(&bytes, 40) as usize;
    let l2_off = (be64(&bytes, l1_off) & 0x00ff_ffff_ffff_fe00) as usize;
    let reftable = be64(&bytes, 48);
    let variant = |name: &str, at: usize, v: u64| -> PathBuf {
        let mut b = bytes.clone();
        b[at..at + 8].copy_from_slice(&v.to_be_bytes());
        let p = d.join(format!("{name}.qcow2"));
        std::fs::write(&p, &b).unwrap();
        p
    };
    let cases = [
        // The magic and version are the header's first 8 bytes.
        (variant("magic", 0, 0x5846_497f_0000_0003), "no qcow2 magic"),
        (variant("version", 0, 0x5146_49fb_0000_0009), "v9"),
        (variant("l1-past-eof", 40, 1 << 40), "past the end"),
        (variant("reftable-past-eof", 48, 1 << 40), "past the end"),
        (
            variant("l1-on-reftable", 40, reftable),
            "overlapping metadata",
        ),
        (
            variant("l2-on-reftable", l1_off, (1 << 63) | reftable),
            "overlapping metadata",
        ),
        (
            variant("size-absurd", 24, u64::MAX / 2),
            "too small for its virtual size",
        ),
        (
            variant("incompatible-bit", 72, 1 << 20),
            "incompatible feature",
        ),
    ];
    for (image, what) in &cases {
        refused(d, image, what);
    }

    // A loop: a's backing is b, b's is a.
    let create = |name: &str, backing: &str| {
        qemu_img(&[
            "create",
            "-q",
            "-f",
            "qcow2",
            "-u",
            "-b",
            backing,
            "-F",
            "qcow2",
            d.join(name).to_str().unwrap(),
            "4M",
        ]);
    };
    create("loop-b.qcow2", "loop-a.qcow2");
    create("loop-a.qcow2", "loop-b.qcow2");
    refused(d, &d.join("loop-a.qcow2"), "loops");

    // A chain one deeper than the bound: a base and MAX_CHAIN overlays.
    let base = d.join("deep-0.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", base.to_str().unwrap(), "4M"]);
    let max = ringblk::disk::qcow2::MAX_CHAIN;
    for i in 1..=max {
        create(&format!("deep-{i}.qcow2"), &format!("deep-{}.qcow2", i - 1));
    }
    refused(
        d,
        &d.join(format!("deep-{max}.qcow2")),
        &format!("deeper than {max}"),
    );
    // The bound itself is served.
    let ok = Daemon::start_in(
        d,
        DaemonOptions {
            image: Some(d.join(format!("deep-{}.qcow2", max - 1))),
            args: &["--format", "qcow2"],
            ..DaemonOptions::default()
        },
    );
    stop(ok);

    // An L2 entry past the end of the file: the daemon starts, the
    // requests on that cluster fail, the others are served.
    let bad_l2 = variant("l2-entry-past-eof", l2_off, (1 << 63) | (1 << 45));
    let daemon = Daemon::start_in(
        d,
        DaemonOptions {
            image: Some(bad_l2.clone()),
            args: &["--format", "qcow2"],
            ..DaemonOptions::default()
        },
    );
    let mut client = Client::connect(&daemon.socket, MIB as usize);
    let read0 = Op::Read {
        offset: 0,
        buf_off: 0,
        len: 4096,
    };
    assert_ne!(client.batch(&[read0])[0], 0, "a read of the bad cluster");
    assert_ne!(
        client.write(0, &[7u8; 4096]),
        0,
        "a write of the bad cluster"
    );
    // The rest of the disk: a read, an allocating write, a flush.
    assert_eq!(client.read(2 * MIB, 4096), vec![0u8; 4096]);
    assert_eq!(client.write(2 * MIB, &[9u8; 4096]), 0);
    assert_eq!(client.read(2 * MIB, 4096), vec![9u8; 4096]);
    assert_eq!(client.flush(), 0);
    // The failure again: nothing was cached from the first.
    assert_ne!(
        client.batch(&[read0])[0],
        0,
        "a second read of the bad cluster"
    );
    drop(client);
    stop(daemon);
}

/// `ctl status`, parsed.
pub(crate) fn status(api: &Path) -> serde_json::Value {
    let out = ctl(api, &["status"]);
    serde_json::from_slice(&out.stdout).unwrap()
}

/// The chain `ctl status` shows, top first.
pub(crate) fn status_chain(api: &Path) -> Vec<String> {
    status(api)["chain"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap().to_string())
        .collect()
}

pub(crate) fn canonical(p: &Path) -> String {
    std::fs::canonicalize(p)
        .unwrap()
        .to_str()
        .unwrap()
        .to_string()
}

/// `ctl snapshot --overlay NAME`, which must succeed.
pub(crate) fn snapshot(api: &Path, name: &str) {
    let out = ctl(api, &["snapshot", "--overlay", name]);
    assert!(
        out.status.success(),
        "ctl snapshot: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Writes `n` 40 KiB writes of pattern `seed + i`, spread over the disk
/// (over clusters the lower images have, and new ones), through `client`
/// and into the reference.
pub(crate) fn write_round(client: &mut Client, c: &Chain, seed: u64, n: u64) {
    for i in 0..n {
        let offset = (i * 5 + seed % 3) * CLUSTER + 4 * KIB;
        let data = c.write(seed + i, offset, 40 * KIB as usize);
        assert_eq!(client.write(offset, &data), 0, "write at {offset}");
    }
    assert_eq!(client.flush(), 0);
}

/// The whole disk, read through `client`, equals the reference.
pub(crate) fn reads_as_reference(client: &mut Client, c: &Chain, when: &str) {
    let chunk = 2 * MIB;
    for offset in (0..SIZE).step_by(chunk as usize) {
        let got = client.read(offset, chunk as usize);
        assert!(
            got == c.expected(offset, chunk as usize),
            "{when}: the 2 MiB at {offset} differ from what the guest wrote"
        );
    }
}

/// A restart after live snapshots, with the very same command line (as
/// systemd restarts a daemon that was killed): the daemon follows the
/// snapshot records to the current top, says so at WARN, and the guest
/// reads every write it made, those after the snapshots included. Two
/// snapshots, a kill -9 after each. The old tops are byte for byte what
/// they were at their snapshots; every image checks clean; `ctl status`
/// shows the followed chain, and the serial is the one the guest had. A
/// record cut short (a snapshot that crashed before its record was
/// synced) is skipped.
#[test]
fn a_restart_after_live_snapshots_serves_the_new_top() {
    let dir = test_dir();
    let c = chain(dir.path(), "raw", SIZE);
    let api = dir.path().join("api.sock");
    let snaps = dir.path().join("snaps");
    std::fs::create_dir(&snaps).unwrap();
    let args = [
        "--api",
        api.to_str().unwrap(),
        "--snapshot-dir",
        snaps.to_str().unwrap(),
    ];
    let mut d = serve(&c, dir.path(), &args);
    let serial = status(&api)["serial"].clone();
    // A dirty bitmap, in the image.
    let out = ctl(&api, &["bitmap", "add", "b"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut client = Client::connect(&d.socket, 2 * MIB as usize);
    write_round(&mut client, &c, 1, 8);
    let at_s1 = dir.path().join("at-s1.raw");
    std::fs::copy(&c.reference, &at_s1).unwrap();
    snapshot(&api, "s1.qcow2");
    let top_sum = sha256(&c.top);
    write_round(&mut client, &c, 100, 8);
    // Killed while the client is still connected: the image is held, its
    // bitmap in use. (After the client left, the daemon lets the image go
    // and writes the bitmap back complete: a kill then races that.)
    let st = d.signal_and_wait(libc::SIGKILL, Duration::from_secs(10));
    assert!(!st.success());
    drop(client);
    // A record cut short by a crash: not a record.
    std::fs::write(
        snaps.join("s9.qcow2.ringblk-snapshot"),
        b"{\"ringblk_snapshot\":1,\"supersed",
    )
    .unwrap();

    let s1 = snaps.join("s1.qcow2");
    let mut d = serve(&c, dir.path(), &args);
    let mut client = Client::connect(&d.socket, 2 * MIB as usize);
    reads_as_reference(&mut client, &c, "after the first restart");
    let log = d.log();
    let warn = log
        .lines()
        .find(|l| l.contains("was superseded by live snapshot"))
        .unwrap_or_else(|| panic!("no line says the image was superseded:\n{log}"));
    assert!(warn.contains("WARN"), "{warn}");
    assert!(
        warn.contains(&format!("serving {}", canonical(&s1))),
        "{warn}"
    );
    assert_eq!(
        status_chain(&api),
        [canonical(&s1), canonical(&c.top), canonical(&c.base)]
    );
    // The guest sees the same disk: the serial is the named image's, and
    // so is the status's name. The bitmap is in the image: the snapshot
    // wrote it into the new top, in use, so after the kill -9 it is found
    // there, inconsistent (QEMU's in-use bitmap; a sidecar would have
    // been complete, but qemu-img would not see it).
    assert_eq!(status(&api)["serial"], serial);
    assert_eq!(
        status(&api)["image"].as_str().map(Path::new),
        Some(c.top.as_path())
    );
    let out = ctl(&api, &["bitmap", "list", "--json"]);
    let list: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("bitmap list: {e}: {}", String::from_utf8_lossy(&out.stderr)));
    let b = list
        .as_array()
        .and_then(|l| l.iter().find(|b| b["name"] == "b"))
        .unwrap_or_else(|| panic!("bitmap b lost across the restart: {list}"));
    assert_eq!(b["consistent"], false, "{b}");
    // A second snapshot, of the followed top, and a second kill -9.
    write_round(&mut client, &c, 200, 4);
    snapshot(&api, "s2.qcow2");
    let s1_sum = sha256(&s1);
    let at_s2 = dir.path().join("at-s2.raw");
    std::fs::copy(&c.reference, &at_s2).unwrap();
    write_round(&mut client, &c, 300, 8);
    let st = d.signal_and_wait(libc::SIGKILL, Duration::from_secs(10));
    assert!(!st.success());
    drop(client);

    let s2 = snaps.join("s2.qcow2");
    let d = serve(&c, dir.path(), &args);
    let mut client = Client::connect(&d.socket, 2 * MIB as usize);
    reads_as_reference(&mut client, &c, "after the second restart");
    assert_eq!(
        status_chain(&api),
        [
            canonical(&s2),
            canonical(&s1),
            canonical(&c.top),
            canonical(&c.base)
        ]
    );
    write_round(&mut client, &c, 400, 4);
    drop(client);
    stop(d);
    assert_eq!(sha256(&c.top), top_sum, "the old top was written");
    assert_eq!(
        sha256(&s1),
        s1_sum,
        "s1 was written after it was superseded"
    );
    assert_eq!(sha256(&c.base), c.base_sum);
    check_clean(&c.top);
    check_clean(&s1);
    check_clean(&s2);
    compare_identical(&c.top, &at_s1);
    compare_identical(&s1, &at_s2);
    compare_identical(&s2, &c.reference);
}

/// Records the images disagree with are refused at start, with one line
/// that says what to do: the overlay a record names is missing, or it is
/// there but its backing file is not the image the record says it
/// superseded. The old top is not served meanwhile. Before that, a
/// snapshot whose record cannot be created fails and leaves nothing.
#[test]
fn a_restart_refuses_snapshot_records_the_images_disagree_with() {
    let dir = test_dir();
    let c = chain(dir.path(), "raw", SIZE);
    let api = dir.path().join("api.sock");
    let snaps = dir.path().join("snaps");
    std::fs::create_dir(&snaps).unwrap();
    let args = [
        "--api",
        api.to_str().unwrap(),
        "--snapshot-dir",
        snaps.to_str().unwrap(),
    ];
    let mut d = serve(&c, dir.path(), &args);
    let mut client = Client::connect(&d.socket, 2 * MIB as usize);
    // The records' names are not overlays'.
    let reserved = ctl(&api, &["snapshot", "--overlay", "x.ringblk-snapshot"]);
    assert_eq!(reserved.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&reserved.stderr).contains("snapshot records"));
    // A snapshot whose record cannot be created (a file of its name is
    // there) fails whole: no overlay is left, the stranger's file stays,
    // and the old top goes on taking writes.
    let stranger = snaps.join("s0.qcow2.ringblk-snapshot");
    std::fs::write(&stranger, b"not ours").unwrap();
    let failed = ctl(&api, &["snapshot", "--overlay", "s0.qcow2"]);
    assert_eq!(failed.status.code(), Some(1));
    let err = String::from_utf8_lossy(&failed.stderr);
    assert!(err.contains("writing the snapshot record"), "{err}");
    assert!(!snaps.join("s0.qcow2").exists());
    assert_eq!(std::fs::read(&stranger).unwrap(), b"not ours");
    write_round(&mut client, &c, 50, 2);
    snapshot(&api, "s1.qcow2");
    write_round(&mut client, &c, 1, 4);
    drop(client);
    let st = d.signal_and_wait(libc::SIGKILL, Duration::from_secs(10));
    assert!(!st.success());
    let top_sum = sha256(&c.top);
    let s1 = snaps.join("s1.qcow2");
    let moved = dir.path().join("s1-moved.qcow2");
    std::fs::rename(&s1, &moved).unwrap();
    refused_with(dir.path(), &c.top, &args, "which is missing");
    // An overlay of that name whose backing file is the base, not the
    // image the record says it superseded.
    overlay(&c.base, "raw", &s1);
    refused_with(
        dir.path(),
        &c.top,
        &args,
        "the records and the images disagree",
    );
    assert_eq!(sha256(&c.top), top_sum, "the old top was written");
    check_clean(&c.top);
    // Put back, the chain is served again.
    std::fs::rename(&moved, &s1).unwrap();
    let d = serve(&c, dir.path(), &args);
    let mut client = Client::connect(&d.socket, 2 * MIB as usize);
    reads_as_reference(&mut client, &c, "with the overlay back");
    drop(client);
    stop(d);
    check_clean(&s1);
    compare_identical(&s1, &c.reference);
}

/// `qemu-img info` of `image`: its error output if it fails.
fn qemu_img_refuses(image: &Path) -> Option<String> {
    let out = std::process::Command::new("qemu-img")
        .args(["info", "-f", "qcow2"])
        .arg(image)
        .output()
        .unwrap();
    (!out.status.success()).then(|| String::from_utf8_lossy(&out.stderr).into_owned())
}

/// The header's autoclear bit 62 (the L2 log's mark) and incompatible
/// bit 62 (the mark before), as the file has them.
fn marks(image: &Path) -> (bool, bool) {
    let mut h = [0u8; 96];
    std::fs::File::open(image)
        .unwrap()
        .read_exact_at(&mut h, 0)
        .unwrap();
    (h[88] & 0x40 != 0, h[72] & 0x40 != 0)
}

/// `qemu-img convert` of `image` to raw, read whole.
fn converted(image: &Path, dir: &Path) -> Vec<u8> {
    let out = dir.join("converted.raw");
    qemu_img(&[
        "convert",
        "-f",
        "qcow2",
        "-O",
        "raw",
        image.to_str().unwrap(),
        out.to_str().unwrap(),
    ]);
    let data = std::fs::read(&out).unwrap();
    std::fs::remove_file(&out).unwrap();
    data
}

/// Allocating writes, a FLUSH, then more allocating writes (new clusters)
/// and rewrites in place (of clusters the first writes allocated), none
/// flushed, then kill -9. Returns the disk as of the FLUSH with the
/// rewrites in place laid over it: what QEMU must read from the image
/// file alone, the L2 log aside.
fn writes_then_kill_9(c: &Chain, mut d: Daemon, seed: u64) -> Vec<u8> {
    let mut client = Client::connect(&d.socket, 2 * MIB as usize);
    for i in 0..32u64 {
        let offset = i * 3 * CLUSTER + 8 * KIB;
        let data = c.write(seed + i, offset, 4 * KIB as usize);
        assert_eq!(client.write(offset, &data), 0, "write at {offset}");
    }
    assert_eq!(client.flush(), 0);
    let mut at_flush = std::fs::read(&c.reference).unwrap();
    for i in 0..64u64 {
        let offset = (i * 3 + 1) * CLUSTER + 8 * KIB;
        let data = c.write(seed + 100 + i, offset, 4 * KIB as usize);
        assert_eq!(client.write(offset, &data), 0, "write at {offset}");
    }
    for i in 0..8u64 {
        let offset = i * 3 * CLUSTER + 16 * KIB;
        let data = c.write(seed + 200 + i, offset, 4 * KIB as usize);
        assert_eq!(client.write(offset, &data), 0, "write at {offset}");
        at_flush[offset as usize..offset as usize + data.len()].copy_from_slice(&data);
    }
    let st = d.signal_and_wait(libc::SIGKILL, Duration::from_secs(10));
    assert!(!st.success());
    drop(client);
    at_flush
}

/// kill -9 of the daemon while the guest is connected and has written
/// since its last FLUSH: the L2 entries of the allocating writes since
/// are in the L2 log only, and the image is marked with autoclear bit
/// 62, which QEMU ignores: right after the kill, `qemu-img info`, `check`
/// (no corruption) and `convert` open the image, and `convert` gives the
/// disk as of the FLUSH, with the rewrites in place since (the newer
/// allocations, in the log only, read as before). The daemon restarted
/// with the same command line writes the log into the image at start-up
/// (and says so), before any guest connects. Every acknowledged write
/// reads back, and after a clean stop QEMU checks the image clean and
/// finds it identical to the reference. The same with `--l2-log off`: no
/// log, nothing marked, and the file alone has every write.
///
/// On the old code the mark was incompatible bit 62: QEMU refused the
/// image ("Unknown incompatible feature").
#[test]
fn a_kill_9_leaves_allocations_in_the_l2_log_and_loses_none() {
    for l2_log in ["on", "off"] {
        let dir = test_dir();
        let c = chain(dir.path(), "raw", SIZE);
        let args = ["--l2-log", l2_log];
        let d = serve(&c, dir.path(), &args);
        let at_flush = writes_then_kill_9(&c, d, 500);
        let log = dir.path().join("top.qcow2.ringblk-l2log");
        if let Some(err) = qemu_img_refuses(&c.top) {
            panic!("--l2-log {l2_log}: right after the kill, qemu-img refused the image: {err}");
        }
        assert_eq!(
            marks(&c.top),
            (l2_log == "on", false),
            "--l2-log {l2_log}: the marks"
        );
        assert_eq!(
            log.exists(),
            l2_log == "on",
            "--l2-log {l2_log}: the L2 log"
        );
        check_clean(&c.top);
        let alone = converted(&c.top, dir.path());
        if l2_log == "on" {
            assert!(
                alone == at_flush,
                "qemu-img convert of the image without its L2 log is not the disk as of the FLUSH"
            );
        } else {
            assert!(
                alone == std::fs::read(&c.reference).unwrap(),
                "--l2-log off: qemu-img convert lacks acknowledged writes"
            );
        }

        // Started and stopped, no guest: the log is written in at start.
        let mut d = serve(&c, dir.path(), &args);
        if l2_log == "on" {
            d.wait_for_log("L2 entries it had left in");
            let out = d.log();
            assert!(
                out.lines()
                    .any(|l| l.contains("L2 entries it had left in") && l.contains("WARN")),
                "the restart did not say it wrote the log in:\n{out}"
            );
        }
        stop(d);
        assert_eq!(
            marks(&c.top),
            (false, false),
            "--l2-log {l2_log}: marks after a stop"
        );
        check_clean(&c.top);
        compare_identical(&c.top, &c.reference);

        let d = serve(&c, dir.path(), &args);
        let mut client = Client::connect(&d.socket, 2 * MIB as usize);
        reads_as_reference(&mut client, &c, "after the kill -9 and restart");
        drop(client);
        stop(d);
        c.verify();
    }
}

/// A program that writes the image after a kill -9 (here qemu-io) clears
/// the autoclear bits it does not know, the L2 log's mark among them: the
/// clusters the log's entries point to are free to it, and it may have
/// taken them. The restart drops the log, says so at WARN, and writes
/// nothing of it: the image checks clean and reads as the disk at the
/// FLUSH with the rewrites in place and qemu-io's write; the allocating
/// writes after the FLUSH are gone (the guest had not flushed them).
/// On the old code qemu-io refused the image (incompatible bit 62).
#[test]
fn a_qemu_write_after_a_kill_9_drops_the_l2_log() {
    let dir = test_dir();
    let c = chain(dir.path(), "raw", SIZE);
    let d = serve(&c, dir.path(), &[]);
    let mut want = writes_then_kill_9(&c, d, 900);
    assert_eq!(marks(&c.top), (true, false), "the image is not marked");
    // qemu-io allocates a cluster no write touched: the first free one
    // in the file, which the log's entries may point to.
    let off = 2 * MIB + 5 * CLUSTER;
    ringblk_testkit::qemu_img::run(
        "qemu-io",
        &[
            "-f",
            "qcow2",
            "-c",
            &format!("write -P 0x5a {off} 64k"),
            c.top.to_str().unwrap(),
        ],
    );
    want[off as usize..(off + CLUSTER) as usize].fill(0x5a);
    assert_eq!(marks(&c.top), (false, false), "qemu-io left the mark set");
    std::fs::write(&c.reference, &want).unwrap();

    let mut d = serve(&c, dir.path(), &[]);
    d.wait_for_log("does not apply");
    let out = d.log();
    assert!(
        out.lines().any(|l| l.contains("does not apply")
            && l.contains("another program")
            && l.contains("WARN")),
        "the restart did not say it dropped the log:\n{out}"
    );
    assert!(
        !out.contains("L2 entries it had left in"),
        "the restart wrote the stale log in:\n{out}"
    );
    let mut client = Client::connect(&d.socket, 2 * MIB as usize);
    reads_as_reference(&mut client, &c, "after qemu-io's write and the restart");
    drop(client);
    stop(d);
    c.verify();
}

/// A FLUSH makes the image whole without the L2 log: allocating writes,
/// a FLUSH, then kill -9: the image is not marked, and QEMU alone (no
/// ringblk replaying anything) reads every write, and checks it clean.
#[test]
fn a_flush_leaves_nothing_in_the_l2_log() {
    let dir = test_dir();
    let c = chain(dir.path(), "raw", SIZE);
    let mut d = serve(&c, dir.path(), &[]);
    let mut client = Client::connect(&d.socket, 2 * MIB as usize);
    for i in 0..64u64 {
        let offset = i * 3 * CLUSTER + 8 * KIB;
        let data = c.write(700 + i, offset, 4 * KIB as usize);
        assert_eq!(client.write(offset, &data), 0, "write at {offset}");
    }
    assert_eq!(client.flush(), 0);
    let st = d.signal_and_wait(libc::SIGKILL, Duration::from_secs(10));
    assert!(!st.success());
    drop(client);
    if let Some(err) = qemu_img_refuses(&c.top) {
        panic!("after a FLUSH, qemu-img refused the image: {err}");
    }
    c.verify();
}

use ringblk_testkit::qemu_img::bitmaps as qemu_bitmaps;

/// QEMU's persistent bitmaps (`qemu-img bitmap --add`) on an image the
/// daemon serves writable are tracked in the image itself:
/// - after a clean stop, `qemu-img info` lists them without `in-use`, QEMU
///   (qemu-nbd's `qemu:dirty-bitmap:`, read by nbdinfo) finds dirty what
///   the guest wrote and nothing else, and a bitmap added with `ringblk
///   ctl bitmap add` is there too; `qemu-img check` finds no leak;
/// - after a kill -9, they are `in-use` (QEMU's "inconsistent": a backup
///   tool copies everything), and the image checks clean.
///
/// On the old code the bitmaps vanished from `qemu-img info` (imago
/// cleared the autoclear bit at open) and their clusters were leaks.
#[test]
fn qemu_bitmaps_are_tracked_in_the_image() {
    for sig in [libc::SIGTERM, libc::SIGKILL] {
        let dir = test_dir();
        let img = qcow2_with_bitmap(dir.path(), "8M", "nightly");
        let p = img.to_str().unwrap();
        qemu_img(&["bitmap", "--add", "-g", "4096", p, "fine"]);
        let api = dir.path().join("api.sock");
        let mut d = start_overlay(dir.path(), &img, &[]);
        let listed = ringblk_testkit::ctl_ok(&api, &["bitmap", "list"]);
        assert!(
            listed.contains("nightly") && listed.contains("fine"),
            "{listed}"
        );
        ringblk_testkit::ctl_ok(&api, &["bitmap", "add", "ours", "--granularity", "1M"]);
        let mut client = Client::connect(&d.socket, MIB as usize);
        let mut data = vec![0u8; 128 * KIB as usize];
        fill(7, 0, &mut data);
        assert_eq!(client.write(MIB, &data), 0);
        assert_eq!(client.write(5 * MIB + 4096, &data[..4096]), 0);
        assert_eq!(client.flush(), 0);
        let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        if sig == libc::SIGTERM {
            // Stopped with the front-end still connected: the daemon lets
            // the image go as it stops.
            stop(d);
            drop(client);
            let mut listed = qemu_bitmaps(&img);
            listed.sort();
            assert_eq!(
                listed,
                [
                    ("fine".to_string(), s(&["auto"])),
                    ("nightly".to_string(), s(&["auto"])),
                    ("ours".to_string(), s(&["auto"])),
                ]
            );
            let leaks = check_clean(&img);
            assert_eq!(leaks, 0, "the old bitmap clusters leaked");
            let dirty = |name| ringblk_testkit::nbd::qemu_nbd_dirty(&img, name);
            assert_eq!(dirty("nightly"), [(MIB, 128 * KIB), (5 * MIB, 64 * KIB)]);
            assert_eq!(dirty("fine"), [(MIB, 128 * KIB), (5 * MIB + 4096, 4096)]);
            assert_eq!(dirty("ours"), [(MIB, MIB), (5 * MIB, MIB)]);
        } else {
            // Killed while the front-end holds the image. ("ours" was
            // written when the `bitmap add` verb let the image go.)
            d.signal_and_wait(sig, Duration::from_secs(20));
            drop(client);
            let mut listed = qemu_bitmaps(&img);
            listed.sort();
            assert_eq!(
                listed,
                [
                    ("fine".to_string(), s(&["in-use", "auto"])),
                    ("nightly".to_string(), s(&["in-use", "auto"])),
                    ("ours".to_string(), s(&["in-use", "auto"])),
                ]
            );
            check_clean(&img);
            // ringblk, restarted, finds them inconsistent too.
            let d = start_overlay(dir.path(), &img, &[]);
            let table = ringblk_testkit::ctl_ok(&api, &["bitmap", "list"]);
            let inconsistent = table
                .lines()
                .filter(|l| l.contains("NO: take a full backup"))
                .count();
            assert_eq!(inconsistent, 3, "{table}");
            stop(d);
        }
        let raw = dir.path().join("disk.raw");
        qemu_img(&["convert", "-O", "raw", p, raw.to_str().unwrap()]);
        let got = std::fs::read(&raw).unwrap();
        assert!(got[MIB as usize..MIB as usize + data.len()] == data[..]);
    }
}

/// A bitmaps extension QEMU would refuse (here: 70000 bitmaps, past its
/// bound of 65535) refuses the start in one line, and the file is left
/// as it was.
#[test]
fn a_bad_bitmaps_extension_is_refused() {
    let dir = test_dir();
    let img = qcow2_with_bitmap(dir.path(), "8M", "nightly");
    let mut bytes = std::fs::read(&img).unwrap();
    let be32 = |b: &[u8], at: usize| u32::from_be_bytes(b[at..at + 4].try_into().unwrap());
    let mut at = be32(&bytes, 100) as usize;
    while be32(&bytes, at) != 0x2385_2875 {
        at += 8 + (be32(&bytes, at + 4) as usize).next_multiple_of(8);
    }
    bytes[at + 8..at + 12].copy_from_slice(&70000u32.to_be_bytes());
    std::fs::write(&img, &bytes).unwrap();
    refused(dir.path(), &img, "bitmaps extension: 70000 bitmaps");
    assert!(
        std::fs::read(&img).unwrap() == bytes,
        "the file was written"
    );
}

/// An incremental backup from a bitmap QEMU made (`qemu-img bitmap
/// --add`): the export's `qemu:dirty-bitmap:` holds what the guest wrote
/// before `backup start`; after `backup stop` and a clean stop of the
/// daemon, QEMU finds in the bitmap exactly what the guest wrote after
/// the instant.
#[test]
fn a_qemu_bitmap_drives_an_incremental_backup() {
    use ringblk_testkit::nbd;
    assert!(nbd::have_tools(), "nbdinfo is missing");
    let dir = test_dir();
    let img = qcow2_with_bitmap(dir.path(), "16M", "nightly");
    let backups = dir.path().join("backups");
    std::fs::create_dir_all(&backups).unwrap();
    let api = dir.path().join("api.sock");
    let d = start_overlay(
        dir.path(),
        &img,
        &["--backup-dir", backups.to_str().unwrap()],
    );
    incremental_through(d, &api, &backups, &img, "nightly", 3);
}

/// A disabled QEMU bitmap (`qemu-img bitmap --add --disable`: a frozen
/// checkpoint) records nothing, as in QEMU, and comes back as it was,
/// not in use; the enabled one beside it records the writes. Also with
/// the disabled one alone, the write-back happens.
#[test]
fn a_disabled_qemu_bitmap_stays_as_it_was() {
    for with_live in [true, false] {
        let dir = test_dir();
        let img = dir.path().join("disk.qcow2");
        let p = img.to_str().unwrap();
        qemu_img(&["create", "-q", "-f", "qcow2", p, "8M"]);
        qemu_img(&["bitmap", "--add", "--disable", p, "frozen"]);
        if with_live {
            qemu_img(&["bitmap", "--add", p, "live"]);
        }
        let d = Daemon::start_in(
            dir.path(),
            DaemonOptions {
                image: Some(img.clone()),
                args: &["--format", "qcow2"],
                ..DaemonOptions::default()
            },
        );
        let mut client = Client::connect(&d.socket, MIB as usize);
        let data = vec![7u8; 4096];
        assert_eq!(client.write(2 * MIB, &data), 0);
        assert_eq!(client.flush(), 0);
        drop(client);
        stop(d);
        let mut listed = qemu_bitmaps(&img);
        listed.sort();
        let mut want = vec![("frozen".to_string(), Vec::<String>::new())];
        if with_live {
            want.push(("live".to_string(), vec!["auto".to_string()]));
        }
        assert_eq!(listed, want);
        assert_eq!(ringblk_testkit::nbd::qemu_nbd_dirty(&img, "frozen"), []);
        if with_live {
            assert_eq!(
                ringblk_testkit::nbd::qemu_nbd_dirty(&img, "live"),
                [(2 * MIB, 64 * KIB)]
            );
        }
        assert_eq!(check_clean(&img), 0);
    }
}

/// Two daemons on one image with QEMU's bitmaps, as in a migration on
/// shared storage: the second is started while the first serves (so its
/// start finds them in use), and gets the image when the first one's
/// front-end leaves. The second then records on top of what the first
/// wrote back: after both stop, QEMU finds both daemons' writes in the
/// bitmap, not in use, and the image checks clean with no leak. On the
/// first version of the store the second kept what it loaded at start-up
/// (in use, so inconsistent) and lost the first one's bits.
#[test]
fn qemu_bitmaps_follow_the_image_from_daemon_to_daemon() {
    let dir = test_dir();
    let img = qcow2_with_bitmap(dir.path(), "8M", "nightly");
    let start = |sub: &str| start_in_sub(dir.path(), &img, sub);
    let first = start("first");
    let mut a = Client::connect(&first.socket, MIB as usize);
    let data = vec![5u8; 4096];
    assert_eq!(a.write(MIB, &data), 0);
    assert_eq!(a.flush(), 0);
    let second = start("second");
    let mut b = Client::connect(&second.socket, MIB as usize);
    drop(a);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while b.write(3 * MIB, &data) != 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the second daemon never got the image"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(b.flush(), 0);
    drop(b);
    stop(second);
    stop(first);
    assert_eq!(
        qemu_bitmaps(&img),
        [("nightly".to_string(), vec!["auto".to_string()])]
    );
    assert_eq!(
        ringblk_testkit::nbd::qemu_nbd_dirty(&img, "nightly"),
        [(MIB, 64 * KIB), (3 * MIB, 64 * KIB)]
    );
    assert_eq!(check_clean(&img), 0);
}

/// A second daemon started on the image before the first one has served
/// a request (a migration's destination started early, or a stray
/// start): its start writes nothing into the image, and the first one,
/// which claims the image after it, loads the bitmaps consistent. The
/// first daemon's front-end connects and leaves once before the second
/// starts (the rings start and stop, as a guest's firmware and driver
/// make them), so the bitmaps were written back by it; then the second
/// starts, and the first serves the writes. After clean stops QEMU finds
/// the bitmap not in use, dirty exactly where the first daemon wrote,
/// and the image checks clean with no leak. On the old code the second
/// daemon's open marked the bitmaps in use, so the first one loaded them
/// inconsistent at its next claim, and `qemu-img info` listed the bitmap
/// `in-use` after the clean stop.
#[test]
fn a_second_daemon_started_early_leaves_the_bitmaps_alone() {
    let dir = test_dir();
    let img = qcow2_with_bitmap(dir.path(), "8M", "nightly");
    let start = |sub: &str| start_in_sub(dir.path(), &img, sub);
    let first = start("first");
    drop(Client::connect(&first.socket, MIB as usize));
    // The release runs as the rings stop, after the client has gone,
    // and is over when the daemon says the front-end left.
    wait_for_disconnects(&first, 2);
    // Written back, not in use. (`-U`: the daemon keeps QEMU's lock
    // bytes while it runs.)
    let info = qemu_img(&["info", "-U", "--output=json", img.to_str().unwrap()]);
    let info: serde_json::Value = serde_json::from_str(&info).unwrap();
    assert_eq!(
        info["format-specific"]["data"]["bitmaps"][0]["flags"],
        serde_json::json!(["auto"]),
        "after the first daemon's release"
    );
    let before = sha256(&img);
    let second = start("second");
    assert_eq!(
        sha256(&img),
        before,
        "the second daemon's start wrote the image"
    );
    let mut a = Client::connect(&first.socket, MIB as usize);
    let data = vec![6u8; 4096];
    assert_eq!(a.write(2 * MIB, &data), 0);
    assert_eq!(a.flush(), 0);
    drop(a);
    stop(first);
    stop(second);
    assert_eq!(
        qemu_bitmaps(&img),
        [("nightly".to_string(), vec!["auto".to_string()])]
    );
    assert_eq!(
        ringblk_testkit::nbd::qemu_nbd_dirty(&img, "nightly"),
        [(2 * MIB, 64 * KIB)]
    );
    assert_eq!(check_clean(&img), 0);
}

/// QEMU's bitmaps that cannot be marked in use (fdatasync fails with EIO,
/// from a seccomp user notification on the daemon's fdatasync: the disk
/// under the image failing) keep the image unclaimed: no write lands
/// while a bitmap on disk says it is complete. The guest's write waits as
/// for the image lock, then fails with IOERR, and the log says why, not
/// that another process holds the image; `ctl status` shows the lock
/// idle (not waited for), and a verb that needs the image says the same
/// why. Once fdatasync works again, the next write claims the image and
/// lands, and the refused one is not in the image; the bitmap, found in
/// use on disk by that claim, is inconsistent (the next backup of it is a
/// full one), and the image checks clean. On the old code the log and the
/// verb blamed another process.
#[test]
fn bitmaps_that_cannot_be_marked_fail_requests_and_say_why() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    use crate::trap::{Answer, SyscallTrap};

    let dir = test_dir();
    let img = qcow2_with_bitmap(dir.path(), "8M", "nightly");
    let api = dir.path().join("api.sock");
    let trap = SyscallTrap::new(libc::SYS_fdatasync);
    let mut d = Daemon::spawn_in(
        dir.path(),
        DaemonOptions {
            image: Some(img.clone()),
            args: &["--format", "qcow2", "--api", api.to_str().unwrap()],
            configure: Some(&|cmd: &mut std::process::Command| trap.arm(cmd)),
            ..DaemonOptions::default()
        },
    );
    let failing = Arc::new(AtomicBool::new(false));
    let fail = failing.clone();
    // Kept until the daemon has stopped: without it, its fdatasyncs fail.
    let supervisor = trap.serve(move || {
        if fail.load(Ordering::Relaxed) {
            Answer::Fail(libc::EIO)
        } else {
            Answer::Continue
        }
    });
    d.wait_until_ready();
    failing.store(true, Ordering::Relaxed);
    let mut client = Client::connect(&d.socket, MIB as usize);
    let data = vec![9u8; 4096];
    assert_eq!(
        client.write(MIB, &data),
        -libc::EIO,
        "a write while the bitmaps cannot be marked"
    );
    let why = "QEMU's bitmaps in the image could not be marked in use";
    d.wait_for_log(&format!(
        "{why} (the I/O error is in the daemon's log): requests fail until they are"
    ));
    assert!(
        !d.log().contains("locked by another process"),
        "blamed another process:\n{}",
        d.log()
    );
    assert!(
        d.log().contains("marking bitmaps in use") && d.log().contains("Input/output error"),
        "the I/O error is not in the log:\n{}",
        d.log()
    );
    let status: serde_json::Value =
        serde_json::from_str(&ringblk_testkit::ctl_ok(&api, &["status"])).unwrap();
    assert_eq!(status["lock"], "idle", "{status}");
    ringblk_testkit::ctl_fails(&api, &["bitmap", "add", "later"], why);
    failing.store(false, Ordering::Relaxed);
    assert_eq!(client.write(2 * MIB, &data), 0, "once fdatasync works");
    assert_eq!(client.flush(), 0);
    drop(client);
    stop(d);
    drop(supervisor);
    // The failed marking's write landed (only its fdatasync failed): the
    // next claim read the bitmap in use, which it cannot tell from one a
    // crash left, and took it as inconsistent, as QEMU does.
    assert_eq!(
        qemu_bitmaps(&img),
        [(
            "nightly".to_string(),
            vec!["in-use".to_string(), "auto".to_string()]
        )]
    );
    assert_eq!(check_clean(&img), 0);
    let mut reference = vec![0u8; 8 * MIB as usize];
    reference[2 * MIB as usize..][..4096].copy_from_slice(&data);
    let raw = dir.path().join("reference.raw");
    std::fs::write(&raw, &reference).unwrap();
    compare_identical(&img, &raw);
}

/// A live snapshot of an image with a bitmap: the old top, frozen by the
/// snapshot, gets its bitmaps written back as they were at the snapshot
/// (not in use: QEMU trusts them), as QEMU stores a node's persistent
/// bitmaps when it becomes read-only; the new top carries the bitmap on.
/// A write before the snapshot and one after, a clean stop: `qemu-img
/// info` lists the bitmap not in use in both; the old top's is dirty
/// where the first write went only, the new top's where both went; the
/// old top was not written after `ctl snapshot` answered, and both check
/// clean. The same with no front-end connected at the snapshot (a guest
/// shut down, its disk snapshotted): the image is held for the snapshot,
/// so the bitmap moves to the new top all the same. On the old code the
/// old top's bitmap stayed `in-use` for good, and a snapshot with no
/// front-end left the new top with no bitmap.
#[test]
fn a_live_snapshot_leaves_the_old_tops_bitmaps_consistent() {
    for connected in [true, false] {
        let dir = test_dir();
        let img = qcow2_with_bitmap(dir.path(), "8M", "nightly");
        let api = dir.path().join("api.sock");
        let snaps = dir.path().join("snaps");
        std::fs::create_dir(&snaps).unwrap();
        let d = start_overlay(
            dir.path(),
            &img,
            &["--snapshot-dir", snaps.to_str().unwrap()],
        );
        let mut client = Client::connect(&d.socket, MIB as usize);
        let data = vec![8u8; 4096];
        assert_eq!(client.write(MIB, &data), 0);
        assert_eq!(client.flush(), 0);
        if !connected {
            drop(client);
            wait_for_disconnects(&d, 2);
            snapshot(&api, "s1.qcow2");
            client = Client::connect(&d.socket, MIB as usize);
        } else {
            snapshot(&api, "s1.qcow2");
        }
        let old_sum = sha256(&img);
        assert_eq!(client.write(3 * MIB, &data), 0);
        assert_eq!(client.flush(), 0);
        drop(client);
        stop(d);
        let case = if connected {
            "connected"
        } else {
            "no front-end"
        };
        assert_eq!(
            sha256(&img),
            old_sum,
            "{case}: the old top was written after the snapshot"
        );
        let s1 = snaps.join("s1.qcow2");
        let consistent = [("nightly".to_string(), vec!["auto".to_string()])];
        assert_eq!(qemu_bitmaps(&img), consistent, "{case}: the old top");
        assert_eq!(qemu_bitmaps(&s1), consistent, "{case}: the new top");
        let dirty = |p: &Path| ringblk_testkit::nbd::qemu_nbd_dirty(p, "nightly");
        assert_eq!(dirty(&img), [(MIB, 64 * KIB)], "{case}: the old top");
        assert_eq!(
            dirty(&s1),
            [(MIB, 64 * KIB), (3 * MIB, 64 * KIB)],
            "{case}: the new top"
        );
        assert_eq!(check_clean(&img), 0);
        assert_eq!(check_clean(&s1), 0);
    }
}

/// A daemon serving `img` as qcow2 from the directory `sub` of `dir`
/// (its own socket): one of several daemons on one image.
fn start_in_sub(dir: &Path, img: &Path, sub: &str) -> Daemon {
    let d = dir.join(sub);
    std::fs::create_dir_all(&d).unwrap();
    Daemon::start_in(
        &d,
        DaemonOptions {
            image: Some(img.to_path_buf()),
            args: &["--format", "qcow2"],
            ..DaemonOptions::default()
        },
    )
}

/// Waits until `d` has said `n` times that its front-end left: the last
/// one's rings have stopped and the image was let go (the bitmaps
/// written back). `n` counts the test kit's probe, which connects and
/// leaves once as the daemon starts (`Daemon::start`), so the first
/// client the test drops is the second to leave.
fn wait_for_disconnects(d: &Daemon, n: usize) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while d.log().matches("front-end disconnected").count() < n {
        assert!(
            std::time::Instant::now() < deadline,
            "the daemon never saw its front-end leave {n} times:\n{}",
            d.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A qcow2 image with QEMU's bitmaps grown online (`ctl resize`): the
/// bitmaps grow with it (the new part dirty: it reads as zeroes now,
/// which no earlier backup has) and QEMU reads them back at the new size,
/// not in use, the image clean.
#[test]
fn qemu_bitmaps_grow_with_the_image() {
    let dir = test_dir();
    let img = qcow2_with_bitmap(dir.path(), "8M", "nightly");
    let api = dir.path().join("api.sock");
    let d = start_overlay(dir.path(), &img, &[]);
    let mut client = Client::connect(&d.socket, MIB as usize);
    assert_eq!(client.write(MIB, &[1u8; 4096]), 0);
    assert_eq!(client.flush(), 0);
    ringblk_testkit::ctl_ok(&api, &["resize", &(16 * MIB).to_string()]);
    drop(client);
    stop(d);
    assert_eq!(
        qemu_bitmaps(&img),
        [("nightly".to_string(), vec!["auto".to_string()])]
    );
    assert_eq!(
        ringblk_testkit::nbd::qemu_nbd_dirty(&img, "nightly"),
        [(MIB, 64 * KIB), (8 * MIB, 8 * MIB)]
    );
    assert_eq!(check_clean(&img), 0);
}

/// A fresh overlay (`qemu-img create -f qcow2 -b base.raw -F raw`, no
/// bitmaps extension) and a daemon serving it with `--api`, `extra`
/// arguments added; returns the overlay and the daemon.
fn fresh_overlay(dir: &Path, extra: &[&str]) -> (PathBuf, Daemon) {
    let base = dir.join("base.raw");
    let img = dir.join("top.qcow2");
    qemu_img(&["create", "-q", "-f", "raw", base.to_str().unwrap(), "16M"]);
    overlay(&base, "raw", &img);
    (img.clone(), start_overlay(dir, &img, extra))
}

fn start_overlay(dir: &Path, img: &Path, extra: &[&str]) -> Daemon {
    let api = dir.join("api.sock");
    let mut args = vec!["--format", "qcow2", "--api", api.to_str().unwrap()];
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

/// The first bitmap of an image without QEMU's bitmaps extension goes
/// into the image, and removing the last one removes the extension, with
/// QEMU as the oracle: `ctl bitmap add b` on a fresh overlay, guest
/// writes, a clean stop: `qemu-img info` lists `b` (not in use), the
/// backing file is still found, `qemu-img check` finds no leak, and QEMU's
/// dirty map (qemu-nbd, nbdinfo) is the written granules; no sidecar
/// was made. Served again, `ctl bitmap remove b`, a clean stop: no bitmap,
/// no leak, the data intact. On the old code the bitmap went to a
/// sidecar (`top.qcow2.bitmap.b`) and `qemu-img info` listed none.
#[test]
fn a_first_bitmap_goes_into_the_image_and_the_last_goes_away() {
    let dir = test_dir();
    let (img, d) = fresh_overlay(dir.path(), &[]);
    let api = dir.path().join("api.sock");
    let name = ringblk_testkit::qemu_img::backing_filename(&img);
    ringblk_testkit::ctl_ok(&api, &["bitmap", "add", "b"]);
    let mut client = Client::connect(&d.socket, MIB as usize);
    let mut data = vec![0u8; 128 * KIB as usize];
    fill(11, 0, &mut data);
    assert_eq!(client.write(MIB, &data), 0);
    assert_eq!(client.write(9 * MIB + 4096, &data[..4096]), 0);
    assert_eq!(client.flush(), 0);
    drop(client);
    stop(d);
    assert!(!dir.path().join("top.qcow2.bitmap.b").exists(), "a sidecar");
    assert_eq!(
        qemu_bitmaps(&img),
        [("b".to_string(), vec!["auto".to_string()])]
    );
    assert_eq!(ringblk_testkit::qemu_img::backing_filename(&img), name);
    assert_eq!(check_clean(&img), 0);
    assert_eq!(
        ringblk_testkit::nbd::qemu_nbd_dirty(&img, "b"),
        [(MIB, 128 * KIB), (9 * MIB, 64 * KIB)]
    );

    let d = start_overlay(dir.path(), &img, &[]);
    let listed = ringblk_testkit::ctl_ok(&api, &["bitmap", "list"]);
    assert!(listed.contains('b'), "{listed}");
    ringblk_testkit::ctl_ok(&api, &["bitmap", "remove", "b"]);
    stop(d);
    assert_eq!(qemu_bitmaps(&img), []);
    assert_eq!(ringblk_testkit::qemu_img::backing_filename(&img), name);
    assert_eq!(check_clean(&img), 0, "the bitmap's clusters leaked");
    let raw = dir.path().join("disk.raw");
    qemu_img(&[
        "convert",
        "-O",
        "raw",
        img.to_str().unwrap(),
        raw.to_str().unwrap(),
    ]);
    let got = std::fs::read(&raw).unwrap();
    assert!(got[MIB as usize..MIB as usize + data.len()] == data[..]);
}

/// A kill -9 after `ctl bitmap add` on an image without bitmaps: QEMU
/// loses a persistent bitmap that was added and not yet stored; ringblk
/// writes the set into the image at `add` (in use), so QEMU lists `b`
/// `in-use` (inconsistent: a backup tool copies everything), the image
/// checks clean, and ringblk restarted lists it inconsistent. On the old
/// code there was no bitmap in the image at all (a sidecar); with the
/// bitmap only in memory until the release (as QEMU keeps it), QEMU
/// listed none.
#[test]
fn a_bitmap_added_to_an_overlay_survives_kill_9_in_use() {
    let dir = test_dir();
    let (img, mut d) = fresh_overlay(dir.path(), &[]);
    let api = dir.path().join("api.sock");
    // Added while the front-end holds the image: no release writes the
    // bitmap out before the kill.
    let mut client = Client::connect(&d.socket, MIB as usize);
    assert_eq!(client.write(0, &[4u8; 4096]), 0);
    ringblk_testkit::ctl_ok(&api, &["bitmap", "add", "b"]);
    assert_eq!(client.write(2 * MIB, &[5u8; 4096]), 0);
    assert_eq!(client.flush(), 0);
    d.signal_and_wait(libc::SIGKILL, Duration::from_secs(20));
    drop(client);
    assert_eq!(
        qemu_bitmaps(&img),
        [(
            "b".to_string(),
            vec!["in-use".to_string(), "auto".to_string()]
        )]
    );
    check_clean(&img);
    let d = start_overlay(dir.path(), &img, &[]);
    let table = ringblk_testkit::ctl_ok(&api, &["bitmap", "list"]);
    assert!(
        table
            .lines()
            .any(|l| l.contains('b') && l.contains("NO: take a full backup")),
        "{table}"
    );
    stop(d);
    assert_eq!(check_clean(&img), 0);
}

/// An incremental backup driven by a bitmap ringblk created in a fresh
/// overlay: the export's `qemu:dirty-bitmap:b` holds what the guest wrote
/// before `backup start`; after `backup stop` and a clean stop, QEMU
/// finds in `b` exactly what the guest wrote after that instant.
#[test]
fn a_ringblk_bitmap_in_an_overlay_drives_an_incremental_backup() {
    use ringblk_testkit::nbd;
    assert!(nbd::have_tools(), "nbdinfo is missing");
    let dir = test_dir();
    let backups = dir.path().join("backups");
    std::fs::create_dir_all(&backups).unwrap();
    let (img, d) = fresh_overlay(dir.path(), &["--backup-dir", backups.to_str().unwrap()]);
    let api = dir.path().join("api.sock");
    ringblk_testkit::ctl_ok(&api, &["bitmap", "add", "b"]);
    incremental_through(d, &api, &backups, &img, "b", 4);
}

/// The incremental backup both bitmap tests run: a 64 KiB write at 1 MiB,
/// `backup start --bitmap NAME` (its map holds that write), a write at
/// 3 MiB, `backup stop`, a clean stop; then QEMU finds in NAME exactly
/// the second write, not in use, and the image checks clean.
fn incremental_through(d: Daemon, api: &Path, backups: &Path, img: &Path, name: &str, seed: u64) {
    use ringblk_testkit::nbd;
    let mut client = Client::connect(&d.socket, MIB as usize);
    let mut data = vec![0u8; 64 * KIB as usize];
    fill(seed, 0, &mut data);
    assert_eq!(client.write(MIB, &data), 0);
    let sock = nbd::backup_start(api, backups, "b.sock", Some(name));
    assert_eq!(nbd::dirty(&sock, name), [(MIB, 64 * KIB)]);
    assert_eq!(client.write(3 * MIB, &data), 0);
    assert_eq!(client.flush(), 0);
    ringblk_testkit::ctl_ok(api, &["backup", "stop"]);
    drop(client);
    stop(d);
    assert_eq!(
        qemu_bitmaps(img),
        [(name.to_string(), vec!["auto".to_string()])]
    );
    assert_eq!(nbd::qemu_nbd_dirty(img, name), [(3 * MIB, 64 * KIB)]);
    assert_eq!(check_clean(img), 0);
}

/// Sidecar bitmaps an older ringblk left next to a qcow2 image are not
/// used (the image's bitmaps are in the image now): the start names them
/// in a warning, and leaves them as they were.
#[test]
fn old_sidecars_of_a_qcow2_image_are_named_at_start() {
    let dir = test_dir();
    let base = dir.path().join("base.raw");
    let img = dir.path().join("top.qcow2");
    qemu_img(&["create", "-q", "-f", "raw", base.to_str().unwrap(), "16M"]);
    overlay(&base, "raw", &img);
    let sidecar = dir.path().join("top.qcow2.bitmap.nightly");
    std::fs::write(&sidecar, b"an old sidecar").unwrap();
    let d = start_overlay(dir.path(), &img, &[]);
    let log = d.log();
    let warn = log
        .lines()
        .find(|l| l.contains("sidecar bitmaps of an older ringblk"))
        .unwrap_or_else(|| panic!("no warning names the sidecars:\n{log}"));
    assert!(warn.contains("WARN"), "{warn}");
    assert!(warn.contains(sidecar.to_str().unwrap()), "{warn}");
    let api = dir.path().join("api.sock");
    let listed = ringblk_testkit::ctl_ok(&api, &["bitmap", "list"]);
    assert!(!listed.contains("nightly"), "{listed}");
    stop(d);
    assert_eq!(std::fs::read(&sidecar).unwrap(), b"an old sidecar");
}

/// A daemon that cannot create the L2 log (here: a directory has its
/// name; in production, an image directory the daemon may not write)
/// says so at WARN, naming it, and serves without it: allocating writes
/// and a FLUSH work, nothing is marked, QEMU checks the image clean.
#[test]
fn an_l2_log_that_cannot_be_made_is_warned_about() {
    let dir = test_dir();
    let c = chain(dir.path(), "raw", SIZE);
    let log = dir.path().join("top.qcow2.ringblk-l2log");
    std::fs::create_dir(&log).unwrap();
    let mut d = serve(&c, dir.path(), &[]);
    let mut client = Client::connect(&d.socket, 2 * MIB as usize);
    for i in 0..16u64 {
        let offset = i * 3 * CLUSTER + 8 * KIB;
        let data = c.write(900 + i, offset, 4 * KIB as usize);
        assert_eq!(client.write(offset, &data), 0, "write at {offset}");
    }
    assert_eq!(client.flush(), 0);
    let out = d.log();
    assert!(
        out.lines().any(|l| l.contains("WARN")
            && l.contains("cannot make the L2 log")
            && l.contains("top.qcow2.ringblk-l2log")),
        "no warning names the L2 log:\n{out}"
    );
    let st = d.signal_and_wait(libc::SIGKILL, Duration::from_secs(10));
    assert!(!st.success());
    drop(client);
    if let Some(err) = qemu_img_refuses(&c.top) {
        panic!("without an L2 log, qemu-img refused the image: {err}");
    }
    c.verify();
}

/// A fresh qcow2 image `disk.qcow2` in `dir`, `size` large, with one
/// QEMU bitmap (`qemu-img bitmap --add`) named `name`.
fn qcow2_with_bitmap(dir: &Path, size: &str, name: &str) -> PathBuf {
    let img = dir.join("disk.qcow2");
    let p = img.to_str().unwrap();
    qemu_img(&["create", "-q", "-f", "qcow2", p, size]);
    qemu_img(&["bitmap", "--add", p, name]);
    img
}
