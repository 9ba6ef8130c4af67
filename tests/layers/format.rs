//! The format layer (src/format) driven directly, with qemu-img and
//! qemu-io as the oracle: overlays over raw, qcow2 and compressed bases,
//! many threads allocating at once, zeroes and growth, backing chains, bad
//! images, and crashes (kill -9 and simulated power loss).

#[path = "format/harness.rs"]
mod harness;

#[path = "format/crash.rs"]
mod crash;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use harness::*;
use ringblk::disk::{self, Format, FormatError, Image, OpenOptions};

/// An overlay over a base with known content (pattern 0), in `dir`.
/// `kind`: "raw", "qcow2" or "compressed" (`qemu-img convert -c`).
fn overlay_over(dir: &Path, kind: &str, size: u64) -> (PathBuf, PathBuf) {
    let raw = dir.join("base.raw");
    raw_base(&raw, size);
    let (base, fmt) = match kind {
        "raw" => (raw.clone(), "raw"),
        "qcow2" => {
            let b = dir.join("base.qcow2");
            qemu_img(&[
                "convert",
                "-O",
                "qcow2",
                raw.to_str().unwrap(),
                b.to_str().unwrap(),
            ]);
            (b, "qcow2")
        }
        "compressed" => {
            let b = dir.join("base.qcow2");
            qemu_img(&[
                "convert",
                "-c",
                "-O",
                "qcow2",
                raw.to_str().unwrap(),
                b.to_str().unwrap(),
            ]);
            (b, "qcow2")
        }
        other => panic!("{other}"),
    };
    let top = dir.join("top.qcow2");
    // A relative backing name: resolved against the overlay's directory.
    overlay(&base, fmt, &top);
    (top, base)
}

/// Writes of every shape (inside one cluster, across clusters, whole
/// clusters, the last bytes) over an overlay, checked against a model.
fn write_and_verify(kind: &str) {
    let dir = scratch(&format!("overlay-{kind}"));
    let size = 16 * MIB;
    let (top, base) = overlay_over(&dir, kind, size);
    let base_sum = sha256(&base);
    let mut model = vec![0u8; size as usize];
    fill(0, 0, &mut model);
    {
        let img = open(&top, true);
        assert_eq!(img.size(), size);
        // Reads fall through to the base.
        let mut buf = vec![0u8; 3 * 65536 + 1000];
        read(&*img, 12345, &mut buf).unwrap();
        assert!(
            buf == model[12345..12345 + buf.len()],
            "base content read wrong"
        );

        let mut rng = Rng(0x5eed ^ kind.len() as u64);
        let shapes: Vec<(u64, u64)> = vec![
            (512, 4096),
            (65536 - 512, 1024),
            (2 * 65536, 65536),
            (5 * 65536 + 4096, 3 * 65536),
            (size - 4096, 4096),
            (0, 512),
        ];
        let mut writes = shapes;
        for _ in 0..60 {
            let len = 512 * (1 + rng.below(256));
            let off = 512 * rng.below((size - len) / 512);
            writes.push((off, len));
        }
        for (i, &(off, len)) in writes.iter().enumerate() {
            let seed = 100 + i as u64;
            let mut data = vec![0u8; len as usize];
            fill(seed, off, &mut data);
            write(&*img, off, &data).unwrap_or_else(|e| panic!("write {len}@{off}: {e}"));
            model[off as usize..(off + len) as usize].copy_from_slice(&data);
            // Read back through both paths.
            let mut back = vec![0u8; len as usize];
            read(&*img, off, &mut back).unwrap();
            assert!(back == data, "write {i} ({len}@{off}) read back wrong");
        }
        let mut all = vec![0u8; size as usize];
        read(&*img, 0, &mut all).unwrap();
        assert!(all == model, "image differs from the model");
        flush(&*img).unwrap();
    }
    assert_eq!(sha256(&base), base_sum, "the base changed");
    check_clean(&top);
    let reference = dir.join("expected.raw");
    std::fs::write(&reference, &model).unwrap();
    compare_identical(&top, &reference);
    // qemu-io reads the first write back.
    let out = run(
        "qemu-io",
        &["-f", "qcow2", "-c", "read -v 512 16", top.to_str().unwrap()],
    );
    let want: Vec<String> = model[512..528].iter().map(|b| format!("{b:02x}")).collect();
    assert!(out.contains(&want[..8].join(" ")), "qemu-io read: {out}");
}

#[test]
fn overlay_on_raw_base() {
    write_and_verify("raw");
}

#[test]
fn overlay_on_qcow2_base() {
    write_and_verify("qcow2");
}

#[test]
fn overlay_on_compressed_base() {
    write_and_verify("compressed");
}

/// Many threads allocating random 4 KiB writes at once on one overlay:
/// no cluster allocated twice, no L2 or refcount update lost.
fn concurrent_allocating_writes(threads: u64) {
    let dir = scratch(&format!("concurrent-{threads}"));
    let size = 32 * MIB;
    let (top, _) = overlay_over(&dir, "qcow2", size);
    let img = Arc::new(open(&top, true));
    let blocks = size / 4096;
    let per_thread = 4096 / threads.max(1);
    std::thread::scope(|s| {
        for t in 0..threads {
            let img = Arc::clone(&img);
            s.spawn(move || {
                let mut rng = Rng(0x1234 + t);
                for _ in 0..per_thread {
                    // Thread t owns the blocks equal to t modulo `threads`,
                    // so the expected content is known, while clusters are
                    // shared between threads.
                    let block = rng.below(blocks / threads) * threads + t;
                    let mut data = vec![0u8; 4096];
                    fill(1000 + t, block * 4096, &mut data);
                    write(&**img, block * 4096, &data).unwrap();
                }
            });
        }
    });
    let syncs = qcow(&**img).syncs();
    flush(&**img).unwrap();
    // The model: replay each thread's writes (deterministic).
    let mut model = vec![0u8; size as usize];
    fill(0, 0, &mut model);
    for t in 0..threads {
        let mut rng = Rng(0x1234 + t);
        for _ in 0..per_thread {
            let block = rng.below(blocks / threads) * threads + t;
            let at = (block * 4096) as usize;
            fill(1000 + t, block * 4096, &mut model[at..at + 4096]);
        }
    }
    // At most one fdatasync per allocated cluster (its copy-on-write data
    // and refcount before its L2 entry), fewer when commits group.
    let clusters: std::collections::HashSet<u64> = (0..threads)
        .flat_map(|t| {
            let mut rng = Rng(0x1234 + t);
            (0..per_thread).map(move |_| (rng.below(blocks / threads) * threads + t) * 4096 / 65536)
        })
        .collect();
    let allocations = clusters.len() as u64;
    eprintln!("{threads} threads: {syncs} fdatasyncs for {allocations} allocations (4096 writes)");
    assert!(
        syncs <= allocations + 2,
        "{syncs} fdatasyncs for {allocations} allocations"
    );
    if threads >= 64 {
        assert!(
            syncs < allocations,
            "no group commit: {syncs} fdatasyncs for {allocations} allocations"
        );
    }
    drop(img);
    let leaks = check_clean(&top);
    assert_eq!(leaks, 0, "a clean run leaked {leaks} clusters");
    let reference = dir.join("expected.raw");
    std::fs::write(&reference, &model).unwrap();
    compare_identical(&top, &reference);
}

#[test]
fn concurrent_2_threads() {
    concurrent_allocating_writes(2);
}

#[test]
fn concurrent_8_threads() {
    concurrent_allocating_writes(8);
}

#[test]
fn concurrent_64_threads() {
    concurrent_allocating_writes(64);
}

/// Write-zeroes and discard: whole clusters become zero clusters (reading
/// zeroes, not the base), their space is punched out of the file, the
/// unaligned edges are written; grow: the new area reads zeroes.
#[test]
fn zeroes_discard_and_grow() {
    let dir = scratch("zeroes");
    let size = 8 * MIB;
    let (top, _) = overlay_over(&dir, "raw", size);
    let mut model = vec![0u8; size as usize];
    fill(0, 0, &mut model);
    let img = open(&top, true);
    // Allocate 2 MiB of the top.
    let mut data = vec![0u8; 2 * MIB as usize];
    fill(7, MIB, &mut data);
    write(&*img, MIB, &data).unwrap();
    model[MIB as usize..3 * MIB as usize].copy_from_slice(&data);
    flush(&*img).unwrap();
    let allocated = std::fs::metadata(&top).unwrap();
    let blocks_before = std::os::unix::fs::MetadataExt::blocks(&allocated);

    // Discard (unmap) most of it, unaligned at both ends.
    let (off, len) = (MIB + 1000, MIB + 5000);
    write_zeroes(&*img, off, len, true).unwrap();
    model[off as usize..(off + len) as usize].fill(0);
    // Write-zeroes without unmap over clusters of the top: zero clusters
    // that keep their allocation, and their old bytes in the file. A
    // write into the middle of one reuses it, and must write its head and
    // tail as zeroes (the copy-on-write of a zero cluster).
    let (off3, len3) = (2 * MIB + 4 * 65536, 3 * 65536);
    write_zeroes(&*img, off3, len3, false).unwrap();
    model[off3 as usize..(off3 + len3) as usize].fill(0);
    let mut mid = vec![0u8; 4096];
    fill(8, off3 + 65536 + 8192, &mut mid);
    write(&*img, off3 + 65536 + 8192, &mid).unwrap();
    let at = (off3 + 65536 + 8192) as usize;
    model[at..at + 4096].copy_from_slice(&mid);
    // Write-zeroes without unmap over the base (unallocated in the top).
    let (off2, len2) = (5 * MIB, 3 * 65536);
    write_zeroes(&*img, off2, len2, false).unwrap();
    model[off2 as usize..(off2 + len2) as usize].fill(0);
    let mut all = vec![0u8; size as usize];
    read(&*img, 0, &mut all).unwrap();
    assert!(all == model, "zeroed image differs from the model");
    flush(&*img).unwrap();
    let blocks_after = std::os::unix::fs::MetadataExt::blocks(&std::fs::metadata(&top).unwrap());
    assert!(
        blocks_after + 1500 < blocks_before,
        "discard gave no space back: {blocks_before} -> {blocks_after} blocks"
    );

    // Grow: the new area reads zeroes (the base is not longer, but the
    // rule holds either way), and can be written.
    img.grow(size + 4 * MIB).unwrap();
    assert_eq!(img.size(), size + 4 * MIB);
    model.resize((size + 4 * MIB) as usize, 0);
    let mut tail = vec![0u8; 4096];
    fill(9, size + MIB, &mut tail);
    write(&*img, size + MIB, &tail).unwrap();
    model[(size + MIB) as usize..(size + MIB) as usize + 4096].copy_from_slice(&tail);
    flush(&*img).unwrap();
    drop(img);
    check_clean(&top);
    let info = qemu_img(&["info", "--output=json", top.to_str().unwrap()]);
    assert!(
        info.contains(&format!("\"virtual-size\": {}", size + 4 * MIB)),
        "{info}"
    );
    let reference = dir.join("expected.raw");
    std::fs::write(&reference, &model).unwrap();
    compare_identical(&top, &reference);
}

/// A chain `depth` images deep (raw at the bottom), each layer with one
/// cluster of its own; returns the top.
fn chain_of(dir: &Path, depth: usize) -> PathBuf {
    let raw = dir.join("l0.raw");
    raw_base(&raw, 4 * MIB);
    let mut below = ("l0.raw".to_string(), "raw");
    for i in 1..depth {
        let name = format!("l{i}.qcow2");
        let path = dir.join(&name);
        qemu_img(&[
            "create",
            "-q",
            "-f",
            "qcow2",
            "-b",
            &below.0,
            "-F",
            below.1,
            path.to_str().unwrap(),
        ]);
        run(
            "qemu-io",
            &[
                "-f",
                "qcow2",
                "-c",
                &format!("write -P {} {} 4k", i, i as u64 * 65536),
                path.to_str().unwrap(),
            ],
        );
        below = (name, "qcow2");
    }
    dir.join(below.0)
}

#[test]
fn long_chains_and_loops() {
    let dir = scratch("chains");
    // 16 images deep: served, each layer's cluster visible.
    let top = chain_of(&dir, disk::qcow2::MAX_CHAIN);
    {
        let img = open(&top, true);
        assert_eq!(img.files().len(), disk::qcow2::MAX_CHAIN);
        for i in 1..disk::qcow2::MAX_CHAIN as u64 {
            let mut b = [0u8; 16];
            read(&*img, i * 65536, &mut b).unwrap();
            assert_eq!(b, [i as u8; 16], "layer {i}'s data");
        }
        let mut b = [0u8; 16];
        read(&*img, 0, &mut b).unwrap();
        let mut want = [0u8; 16];
        fill(0, 0, &mut want);
        assert_eq!(b, want, "the raw bottom's data");
    }
    // One more is refused, with the bound in the message.
    let deeper = dir.join("deeper.qcow2");
    qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-b",
        top.file_name().unwrap().to_str().unwrap(),
        "-F",
        "qcow2",
        deeper.to_str().unwrap(),
    ]);
    let err = open_err(&deeper);
    assert!(err.contains("deeper than 16"), "{err}");

    // A loop: a's backing is b, b's backing is a.
    let a = dir.join("a.qcow2");
    let b = dir.join("b.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", a.to_str().unwrap(), "1M"]);
    qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-b",
        "a.qcow2",
        "-F",
        "qcow2",
        b.to_str().unwrap(),
    ]);
    qemu_img(&[
        "rebase",
        "-u",
        "-f",
        "qcow2",
        "-b",
        "b.qcow2",
        "-F",
        "qcow2",
        a.to_str().unwrap(),
    ]);
    let err = open_err(&a);
    assert!(err.contains("loops"), "{err}");
    // An image that is its own backing file.
    qemu_img(&[
        "rebase",
        "-u",
        "-f",
        "qcow2",
        "-b",
        "a.qcow2",
        "-F",
        "qcow2",
        a.to_str().unwrap(),
    ]);
    let err = open_err(&a);
    assert!(err.contains("loops"), "{err}");
}

fn open_err(path: &Path) -> String {
    open_err_with(path, &OpenOptions::default())
}

fn open_err_with(path: &Path, options: &OpenOptions) -> String {
    match disk::open(path, Format::Qcow2, options) {
        Ok(_) => panic!("{} opened", path.display()),
        Err(e) => {
            let s = e.to_string();
            assert!(!s.contains('\n'), "a multi-line error: {s}");
            s
        }
    }
}

/// Version 2: served read-only; a write is refused.
#[test]
fn v2_is_read_only() {
    let dir = scratch("v2");
    let raw = dir.join("r.raw");
    raw_base(&raw, 2 * MIB);
    let v2 = dir.join("v2.qcow2");
    qemu_img(&[
        "convert",
        "-O",
        "qcow2",
        "-o",
        "compat=0.10",
        raw.to_str().unwrap(),
        v2.to_str().unwrap(),
    ]);
    let err = open_err(&v2);
    assert!(err.contains("version 2"), "{err}");
    let img = open(&v2, false);
    let mut b = vec![0u8; 8192];
    read(&*img, 4096, &mut b).unwrap();
    let mut want = vec![0u8; 8192];
    fill(0, 4096, &mut want);
    assert!(b == want);
    let r = write(&*img, 0, &[1u8; 512]);
    assert!(matches!(r, Err(FormatError::ReadOnly)), "{r:?}");
}

/// The format is never probed: a raw image holding a qcow2 header is raw
/// (its "backing file" is never opened), with one warning naming --format.
#[test]
fn raw_is_never_probed() {
    let dir = scratch("probe");
    let secret = dir.join("secret.raw");
    std::fs::write(&secret, vec![0x5a; 65536]).unwrap();
    // A "guest" wrote a qcow2 header naming the secret into its raw disk.
    let disk = dir.join("disk.raw");
    qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-b",
        secret.to_str().unwrap(),
        "-F",
        "raw",
        disk.to_str().unwrap(),
        "64K",
    ]);
    let header = std::fs::read(&disk).unwrap();
    let img = disk::open(&disk, Format::Raw, &OpenOptions::default()).unwrap();
    assert_eq!(img.files().len(), 1);
    let mut b = vec![0u8; 4];
    read(&*img, 0, &mut b).unwrap();
    assert_eq!(b, &header[..4], "raw must read the file's own bytes");
    let warning = disk::raw_qcow2_warning(&disk, Format::Raw).expect("no warning");
    assert!(warning.contains("--format qcow2"), "{warning}");
    assert!(disk::raw_qcow2_warning(&disk, Format::Qcow2).is_none());
    assert!(disk::raw_qcow2_warning(&secret, Format::Raw).is_none());
}

/// Each kind of bad image: a one-line error at open, or an error for the
/// requests touching the bad part; never a panic.
#[test]
fn bad_images() {
    let dir = scratch("bad");
    let good = dir.join("good.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", good.to_str().unwrap(), "4M"]);
    run(
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

    let variant = |name: &str, patch: &dyn Fn(&mut Vec<u8>)| -> PathBuf {
        let mut b = bytes.clone();
        patch(&mut b);
        let p = dir.join(name);
        std::fs::write(&p, &b).unwrap();
        p
    };
    let put32 =
        |b: &mut Vec<u8>, at: usize, v: u32| b[at..at + 4].copy_from_slice(&v.to_be_bytes());
    let put64 =
        |b: &mut Vec<u8>, at: usize, v: u64| b[at..at + 8].copy_from_slice(&v.to_be_bytes());

    // Refused at open, with what is wrong.
    type Patch<'a> = Box<dyn Fn(&mut Vec<u8>) + 'a>;
    let cases: Vec<(&str, Patch, &str)> = vec![
        ("magic", Box::new(|b| b[0] = b'X'), "qcow2"),
        ("version", Box::new(|b| put32(b, 4, 9)), "v9"),
        (
            "cluster-bits-huge",
            Box::new(|b| put32(b, 20, 40)),
            "cluster size",
        ),
        (
            "cluster-bits-small",
            Box::new(|b| put32(b, 20, 4)),
            "cluster size",
        ),
        (
            "size-absurd",
            Box::new(|b| put64(b, 24, u64::MAX / 2)),
            "too small for its virtual size",
        ),
        (
            "l1-past-eof",
            Box::new(|b| put64(b, 40, 1 << 40)),
            "past the end",
        ),
        (
            "l1-unaligned",
            Box::new(|b| put64(b, 40, 4096 + 8)),
            "Unaligned",
        ),
        ("l1-huge", Box::new(|b| put32(b, 36, u32::MAX)), "too big"),
        (
            "reftable-past-eof",
            Box::new(|b| put64(b, 48, 1 << 40)),
            "past the end",
        ),
        (
            "incompatible-bit",
            Box::new(|b| put64(b, 72, 1 << 20)),
            "incompatible feature",
        ),
        (
            "dirty-bit",
            Box::new(|b| put64(b, 72, 1)),
            "incompatible feature",
        ),
        (
            "corrupt-bit",
            Box::new(|b| put64(b, 72, 2)),
            "incompatible feature",
        ),
        (
            "external-data",
            Box::new(|b| put64(b, 72, 4)),
            "external data file",
        ),
        (
            "backing-name-past-cluster",
            Box::new(|b| {
                put64(b, 8, 65530);
                put32(b, 16, 100);
            }),
            "Backing file name",
        ),
        (
            "backing-protocol",
            Box::new(|b| {
                let name = b"nbd:localhost:10809";
                let at = 4096usize;
                b[at..at + name.len()].copy_from_slice(name);
                put64(b, 8, at as u64);
                put32(b, 16, name.len() as u32);
            }),
            "protocol",
        ),
        ("snapshots", Box::new(|b| put32(b, 60, 1)), "snapshots"),
        (
            "l1-on-reftable",
            Box::new(|b| {
                let rt = u64::from_be_bytes(b[48..56].try_into().unwrap());
                put64(b, 40, rt)
            }),
            "overlapping metadata",
        ),
        (
            "l2-on-reftable",
            Box::new(|b| {
                let rt = u64::from_be_bytes(b[48..56].try_into().unwrap());
                put64(b, l1_off, (1u64 << 63) | rt)
            }),
            "overlapping metadata",
        ),
        (
            "header-length-huge",
            Box::new(|b| put32(b, 100, 1 << 20)),
            "header too big",
        ),
        (
            "refcount-order",
            Box::new(|b| put32(b, 96, 9)),
            "refcount width",
        ),
    ];
    for (name, patch, want) in cases {
        let p = variant(name, &*patch);
        let err = open_err(&p);
        assert!(
            err.to_lowercase().contains(&want.to_lowercase()),
            "{name}: error {err:?} does not say {want:?}"
        );
    }

    // Opened, but the requests touching the bad part fail: an L2 table
    // pointing past the end of the file, and an L1 entry pointing there.
    let p = variant("l2-entry-past-eof", &|b| {
        put64(b, l2_off, (1u64 << 63) | (1 << 45))
    });
    let img = open(&p, true);
    let mut buf = vec![0u8; 4096];
    let err = read(&*img, 0, &mut buf).unwrap_err().to_string();
    assert!(err.contains("past the end"), "{err}");
    assert!(write(&*img, 0, &[1u8; 4096]).is_err());
    // Other clusters still work.
    read(&*img, 2 * MIB, &mut buf).unwrap();
    drop(img);
    let p = variant("l1-entry-past-eof", &|b| {
        put64(b, l1_off, (1u64 << 63) | (1 << 44))
    });
    let img = open(&p, false);
    let err = read(&*img, 0, &mut buf).unwrap_err().to_string();
    assert!(err.contains("past the end"), "{err}");

    // A backing file whose format is not recorded: never probed.
    let nofmt = dir.join("nofmt.qcow2");
    qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-b",
        "good.qcow2",
        "-F",
        "qcow2",
        nofmt.to_str().unwrap(),
    ]);
    // (qemu-img no longer writes such images: turn the backing-format
    // extension into an unknown one.)
    let mut b = std::fs::read(&nofmt).unwrap();
    let at = b[..65536]
        .windows(4)
        .position(|w| w == [0xe2, 0x79, 0x2a, 0xca])
        .expect("no backing-format extension");
    b[at..at + 4].copy_from_slice(&[0x12, 0x34, 0x56, 0x78]);
    std::fs::write(&nofmt, &b).unwrap();
    let err = open_err(&nofmt);
    assert!(err.contains("never probed"), "{err}");
    // zstd-compressed images: imago reads zlib only; refused, not misread.
    let zstd = dir.join("zstd.qcow2");
    qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-o",
        "compression_type=zstd",
        zstd.to_str().unwrap(),
        "1M",
    ]);
    let err = open_err(&zstd);
    assert!(err.contains("incompatible feature"), "{err}");
    // A missing backing file.
    let missing = dir.join("missing.qcow2");
    qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-u",
        "-b",
        "nowhere.raw",
        "-F",
        "raw",
        missing.to_str().unwrap(),
        "1M",
    ]);
    let err = open_err(&missing);
    assert!(err.contains("nowhere.raw"), "{err}");
}

/// After `invalidate`, an image reads what another opener wrote meanwhile
/// (a migration's destination taking the image over), rather than its
/// stale cached mappings.
#[test]
fn invalidate_rereads_metadata() {
    let dir = scratch("invalidate");
    let (top, _) = overlay_over(&dir, "raw", 4 * MIB);
    let reader = open(&top, false);
    let mut buf = vec![0u8; 4096];
    read(&*reader, 65536, &mut buf).unwrap(); // caches "from the base"
    {
        let writer = open(&top, true);
        let mut data = vec![0u8; 4096];
        fill(42, 65536, &mut data);
        write(&*writer, 65536, &data).unwrap();
        flush(&*writer).unwrap();
    }
    let mut want = vec![0u8; 4096];
    fill(42, 65536, &mut want);
    read(&*reader, 65536, &mut buf).unwrap();
    assert!(
        buf != want,
        "the reader saw the write without invalidating (test is void)"
    );
    reader.invalidate().unwrap();
    read(&*reader, 65536, &mut buf).unwrap();
    assert!(buf == want, "stale data after invalidate");
}

fn qemu_bitmaps(img: &Path) -> Vec<(String, Vec<String>)> {
    ringblk_testkit::qemu_img::bitmaps(img)
}

/// QEMU's persistent bitmaps (`qemu-img bitmap --add`) in an image ringblk
/// writes: QEMU still lists them, flagged `in-use` (its "inconsistent":
/// they miss ringblk's writes), and the image checks clean; a read-only
/// open leaves them as they were. On the old code imago cleared the
/// autoclear bit at open, so QEMU dropped the bitmaps: `qemu-img info`
/// listed none (and `check` counted their clusters as leaks).
#[test]
fn qemu_bitmaps_are_marked_in_use_not_dropped() {
    let dir = scratch("qemu-bitmaps");
    let img = dir.join("disk.qcow2");
    let p = img.to_str().unwrap();
    qemu_img(&["create", "-q", "-f", "qcow2", p, "4M"]);
    qemu_img(&["bitmap", "--add", p, "b0"]);
    qemu_img(&["bitmap", "--add", "-g", "512", p, "b1"]);
    let flags = |want: &[&str]| -> Vec<(String, Vec<String>)> {
        ["b0", "b1"]
            .iter()
            .map(|n| (n.to_string(), want.iter().map(|f| f.to_string()).collect()))
            .collect()
    };
    assert_eq!(qemu_bitmaps(&img), flags(&["auto"]));

    drop(open(&img, false));
    assert_eq!(qemu_bitmaps(&img), flags(&["auto"]), "a read-only open");

    let w = open(&img, true);
    assert_eq!(
        qemu_bitmaps(&img),
        flags(&["in-use", "auto"]),
        "in use before the first write"
    );
    let mut data = vec![0u8; 65536];
    fill(3, 0, &mut data);
    write(&*w, 0, &data).unwrap();
    flush(&*w).unwrap();
    // Dropping imago's caches rereads the header, whose autoclear bit
    // imago did not leave set.
    w.invalidate().unwrap();
    write(&*w, 2 * MIB, &data).unwrap();
    flush(&*w).unwrap();
    drop(w);
    assert_eq!(qemu_bitmaps(&img), flags(&["in-use", "auto"]));
    check_clean(&img);
    // QEMU's own way out: remove (or clear) the inconsistent bitmap.
    qemu_img(&["bitmap", "--remove", p, "b1"]);
    assert_eq!(qemu_bitmaps(&img).len(), 1);
    check_clean(&img);
}

/// A bitmaps extension QEMU would refuse is refused, in one line, before
/// anything is written: the file is unchanged.
#[test]
fn bad_bitmaps_extension_is_refused() {
    let dir = scratch("bad-bitmaps");
    let img = dir.join("disk.qcow2");
    let p = img.to_str().unwrap();
    qemu_img(&["create", "-q", "-f", "qcow2", p, "4M"]);
    qemu_img(&["bitmap", "--add", p, "b0"]);
    let bytes = std::fs::read(&img).unwrap();
    let be32 = |b: &[u8], at: usize| u32::from_be_bytes(b[at..at + 4].try_into().unwrap());
    let mut at = be32(&bytes, 100) as usize;
    while be32(&bytes, at) != 0x2385_2875 {
        at += 8 + (be32(&bytes, at + 4) as usize).next_multiple_of(8);
    }
    // nb_bitmaps past QEMU's bound.
    let mut bad = bytes.clone();
    bad[at + 8..at + 12].copy_from_slice(&70000u32.to_be_bytes());
    std::fs::write(&img, &bad).unwrap();
    let err = open_err(&img);
    assert!(
        err.contains("bitmaps extension") && err.contains("70000 bitmaps"),
        "{err}"
    );
    assert!(std::fs::read(&img).unwrap() == bad, "the file was written");
    // A directory past the end of the file.
    let mut bad = bytes.clone();
    bad[at + 24..at + 32].copy_from_slice(&(1u64 << 40).to_be_bytes());
    std::fs::write(&img, &bad).unwrap();
    let err = open_err(&img);
    assert!(err.contains("past the end of the file"), "{err}");
    // Read-only, QEMU's bitmaps are not ringblk's business.
    drop(open(&img, false));
}

/// The bits of a bitmap QEMU wrote (qemu-io writing with a persistent
/// bitmap enabled, which QEMU stores at its clean close), read through
/// the directory and tables by ringblk's parser: the granules written,
/// and none other.
#[test]
fn qemu_bitmap_bits_read_back() {
    use ringblk::bitmap::DirtyBitmap;
    use ringblk::disk::qcow2::bitmaps::Bitmaps;
    use std::os::unix::fs::FileExt;

    let dir = scratch("qemu-bitmap-bits");
    let img = dir.join("disk.qcow2");
    let p = img.to_str().unwrap();
    qemu_img(&["create", "-q", "-f", "qcow2", p, "64M"]);
    qemu_img(&["bitmap", "--add", p, "b64k"]);
    qemu_img(&["bitmap", "--add", "-g", "512", p, "b512"]);
    run(
        "qemu-io",
        &[
            "-f",
            "qcow2",
            "-c",
            "write 1M 64k",
            "-c",
            "write 3000k 1k",
            "-c",
            "write 63M 1M",
            p,
        ],
    );
    let file = std::fs::File::open(&img).unwrap();
    let b = Bitmaps::load(&file).unwrap().unwrap();
    let mut read = |buf: &mut [u8], off: u64| file.read_exact_at(buf, off);
    let mut got = Vec::new();
    for (i, e) in b.entries.iter().enumerate() {
        assert!(!e.in_use(), "{} in use after QEMU's clean close", e.name);
        let words = b.read_words(i, &mut read).unwrap();
        let g = 1u64 << e.granularity_bits;
        let bm = DirtyBitmap::from_words(64 * MIB, g, words, true).unwrap();
        got.push((e.name.clone(), bm.dirty_extents()));
    }
    got.sort();
    let k = 1024;
    assert_eq!(
        got,
        [
            (
                "b512".to_string(),
                vec![(MIB, 64 * k), (3000 * k, k), (63 * MIB, MIB)]
            ),
            (
                "b64k".to_string(),
                vec![(MIB, 64 * k), (2944 * k, 64 * k), (63 * MIB, MIB)]
            ),
        ]
    );
}

fn qemu_dirty(img: &Path, name: &str) -> Vec<(u64, u64)> {
    ringblk_testkit::nbd::qemu_nbd_dirty(img, name)
}

/// ringblk writes QEMU's bitmaps back (`bitmap_write::store`, not wired
/// into the daemon yet): the bits QEMU stored, read by ringblk, changed
/// and stored again with one bitmap more and one inconsistent; QEMU then
/// lists them with the right flags, reads the same dirty ranges over NBD,
/// and `qemu-img check` finds no leak and no corruption (the old
/// clusters were freed).
#[test]
fn qemu_bitmaps_written_back_read_by_qemu() {
    written_back("65536");
}

/// The same with 512-byte clusters: a refblock covers 128 KiB of file,
/// so the new clusters need new refblocks (which cover themselves).
#[test]
fn qemu_bitmaps_written_back_with_new_refblocks() {
    written_back("512");
}

/// `dir/disk.qcow2`, a `size`-byte image made with `qemu-img create -o
/// opts`, with one QEMU bitmap `name` of `granularity`-byte granules.
fn image_with_bitmap(dir: &Path, opts: &str, size: u64, granularity: u64, name: &str) -> PathBuf {
    let img = dir.join("disk.qcow2");
    create_qcow2(&img, opts, None, Some(&size.to_string()));
    let p = img.to_str().unwrap();
    qemu_img(&["bitmap", "--add", "-g", &granularity.to_string(), p, name]);
    img
}

/// [`image_with_bitmap`] whose refcount table covers little (512-byte
/// clusters, 64-bit refcounts: one refblock covers 32 KiB of file, the
/// one-cluster table 2 MiB): its write-back soon needs a larger table.
fn small_refblocks(dir: &Path, size: u64, granularity: u64, name: &str) -> PathBuf {
    image_with_bitmap(
        dir,
        "cluster_size=512,refcount_bits=64",
        size,
        granularity,
        name,
    )
}

/// The refcount table's size in clusters, from the header.
fn reftable_clusters(f: &std::fs::File) -> u32 {
    let mut b = [0u8; 4];
    std::os::unix::fs::FileExt::read_exact_at(f, &mut b, 56).unwrap();
    u32::from_be_bytes(b)
}

/// A write-back that needs more refcount table than the image has: 512-byte
/// clusters with 64-bit refcounts (one refblock covers 32 KiB of file,
/// the image's one-cluster table 2 MiB) and a 4 GiB disk, whose bitmap
/// of 512-byte granules, dirty every MiB, takes 1 MiB of data clusters
/// past the file's 1 MiB. The table is moved to a larger one (the
/// header's refcount table clusters grow), and QEMU then lists the
/// bitmap not in use, reads exactly the marks back, and `qemu-img check`
/// finds no corruption and no leak (the old table freed). On the old
/// code the write-back refused ("the refcount table would need to
/// grow"), and the bitmaps stayed in use.
#[test]
fn qemu_bitmaps_written_back_with_a_grown_refcount_table() {
    use ringblk::bitmap::DirtyBitmap;
    use ringblk::disk::qcow2::bitmap_write::store;
    use ringblk::disk::qcow2::bitmaps::Bitmaps;

    let dir = scratch("qemu-bitmap-write-grown-reftable");
    let size = 4096 * MIB;
    let img = small_refblocks(&dir, size, 512, "b512");
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&img)
        .unwrap();
    assert_eq!(reftable_clusters(&file), 1, "qemu-img's table changed size");
    let old = Bitmaps::load(&file).unwrap().unwrap();
    let b = DirtyBitmap::new(size, 512).unwrap();
    for m in (0..size).step_by(MIB as usize) {
        b.mark(m, 1);
    }
    let new = [stored("b512", &b)];
    store(&file, 512, Some(&old), &new, &|_| false).unwrap();
    assert!(
        reftable_clusters(&file) > 1,
        "the refcount table did not grow"
    );
    drop(file);
    assert_eq!(
        qemu_bitmaps(&img),
        [("b512".to_string(), vec!["auto".to_string()])]
    );
    assert_eq!(check_clean(&img), 0, "leaked clusters");
    let want: Vec<(u64, u64)> = (0..size).step_by(MIB as usize).map(|m| (m, 512)).collect();
    assert!(
        qemu_dirty(&img, "b512") == want,
        "the bits read back differ"
    );
}

/// The write-back that grows the refcount table, as the daemon drives it
/// (staged, written when the image is let go), and imago allocating after
/// it: its caches are reread with the new table, the writes after it
/// allocate through it, and in the end QEMU lists the bitmap not in use,
/// `qemu-img check` finds no corruption and no leak, and the data reads
/// back.
#[test]
fn imago_allocates_after_a_write_back_grew_the_refcount_table() {
    use ringblk::bitmap::DirtyBitmap;

    let dir = scratch("qemu-bitmap-grown-reftable-live");
    let size = 7900 * MIB;
    let img = small_refblocks(&dir, size, 16384, "b");
    let w = open(&img, true);
    let q = qcow(&*w);
    assert_eq!(q.open_qemu_bitmaps().unwrap().len(), 1);
    let b = DirtyBitmap::new(size, 16384).unwrap();
    for m in (0..size).step_by(MIB as usize) {
        b.mark(m, 1);
    }
    assert!(q.stage_qemu_bitmaps(vec![stored("b", &b)]));
    q.invalidate().unwrap();
    assert!(
        reftable_clusters(&std::fs::File::open(&img).unwrap()) > 1,
        "the refcount table did not grow"
    );
    assert_eq!(
        qemu_bitmaps(&img),
        [("b".to_string(), vec!["auto".to_string()])]
    );
    // Allocating writes through imago, after the move: 256 KiB at each
    // of a few places.
    let mut data = vec![0u8; 256 * 1024];
    for (k, at) in [0, 100 * MIB, 4000 * MIB, size - 256 * 1024]
        .into_iter()
        .enumerate()
    {
        fill(k as u64 + 1, at, &mut data);
        write(&*w, at, &data).unwrap();
    }
    flush(&*w).unwrap();
    q.invalidate().unwrap();
    drop(w);
    assert_eq!(check_clean(&img), 0, "leaked clusters");
    // Read back through a fresh open, every place.
    let r = open(&img, false);
    let mut got = vec![0u8; data.len()];
    for (k, at) in [0, 100 * MIB, 4000 * MIB, size - 256 * 1024]
        .into_iter()
        .enumerate()
    {
        fill(k as u64 + 1, at, &mut data);
        read(&*r, at, &mut got).unwrap();
        assert!(got == data, "the data written at {at} after the move");
    }
}

fn written_back(cluster_size: &str) {
    use ringblk::bitmap::DirtyBitmap;
    use ringblk::disk::qcow2::bitmap_write::{Stored, store};
    use ringblk::disk::qcow2::bitmaps::Bitmaps;
    use std::os::unix::fs::FileExt;

    let dir = scratch(&format!("qemu-bitmap-write-{cluster_size}"));
    let img = dir.join("disk.qcow2");
    let p = img.to_str().unwrap();
    // With 512-byte clusters, a 1 GiB disk: b512's bits, dirty every MiB,
    // take 512 data clusters, more than one refblock covers.
    let size = if cluster_size == "512" {
        1024 * MIB
    } else {
        64 * MIB
    };
    let opts = format!("cluster_size={cluster_size}");
    qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-o",
        &opts,
        p,
        &size.to_string(),
    ]);
    qemu_img(&["bitmap", "--add", p, "b64k"]);
    qemu_img(&["bitmap", "--add", "-g", "512", p, "b512"]);
    qemu_img(&["bitmap", "--add", p, "gone"]);
    run("qemu-io", &["-f", "qcow2", "-c", "write 1M 64k", p]);

    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&img)
        .unwrap();
    let old = Bitmaps::load(&file).unwrap().unwrap();
    let mut read = |buf: &mut [u8], off: u64| file.read_exact_at(buf, off);
    let mut new = Vec::new();
    for (i, e) in old.entries.iter().enumerate() {
        if e.name == "gone" {
            continue;
        }
        let g = 1u64 << e.granularity_bits;
        let b =
            DirtyBitmap::from_words(size, g, old.read_words(i, &mut read).unwrap(), true).unwrap();
        b.mark(10 * MIB, 4096);
        b.mark(size - 512, 512);
        if e.name == "b512" {
            for m in (0..size).step_by(MIB as usize) {
                b.mark(m, 1);
            }
        }
        new.push(Stored {
            name: e.name.clone(),
            granularity_bits: e.granularity_bits,
            auto: true,
            consistent: e.name != "b512",
            words: b.words().collect(),
        });
    }
    let fresh = DirtyBitmap::new(size, 1 << 20).unwrap();
    fresh.mark(0, 1);
    fresh.mark(size / 2, size / 2);
    new.push(Stored {
        name: "fresh".into(),
        granularity_bits: 20,
        auto: false,
        consistent: true,
        words: fresh.words().collect(),
    });
    let c: u64 = cluster_size.parse().unwrap();
    store(&file, c, Some(&old), &new, &|_| false).unwrap();
    drop(file);

    let mut listed = qemu_bitmaps(&img);
    listed.sort();
    let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
    assert_eq!(
        listed,
        [
            ("b512".to_string(), s(&["in-use", "auto"])),
            ("b64k".to_string(), s(&["auto"])),
            ("fresh".to_string(), s(&[])),
        ]
    );
    let leaks = check_clean(&img);
    assert_eq!(leaks, 0, "the old clusters were not freed");
    // QEMU's default granularity: the cluster size, within 4 KiB..64 KiB.
    let g = cluster_size.parse::<u64>().unwrap().clamp(4096, 65536);
    assert_eq!(
        qemu_dirty(&img, "b64k"),
        [(MIB, 64 * 1024), (10 * MIB, g), (size - g, g)]
    );
    assert_eq!(qemu_dirty(&img, "fresh"), [(0, MIB), (size / 2, size / 2)]);
}

fn qcow(i: &dyn Image) -> &ringblk::disk::Qcow2Image {
    i.as_qcow2().expect("a qcow2 image")
}

/// `bitmaps_at_claim` (how the daemon opens an image): the open writes
/// nothing into the image, a peek lists the bitmaps consistent and still
/// writes nothing, and `open_qemu_bitmaps` (the claim) marks them in use
/// before it returns the bits (`qemu_bitmaps_marked`, which the daemon
/// checks before it serves, says so). Without the option the open marks them
/// (`qemu_bitmaps_are_marked_in_use_not_dropped`). The old code had no
/// such open: every writable open marked them in use, so a daemon
/// started on an image another one served made the other load them
/// inconsistent (`tests/socket/qcow2.rs` shows that end to end).
#[test]
fn an_open_for_a_later_claim_writes_nothing() {
    let dir = scratch("qemu-bitmaps-at-claim");
    let img = dir.join("disk.qcow2");
    let p = img.to_str().unwrap();
    qemu_img(&["create", "-q", "-f", "qcow2", p, "4M"]);
    qemu_img(&["bitmap", "--add", p, "b"]);
    let before = sha256(&img);
    let options = OpenOptions {
        bitmaps_at_claim: true,
        ..OpenOptions::default()
    };
    let w = disk::open(&img, Format::Qcow2, &options).unwrap();
    let q = qcow(&*w);
    assert!(
        !q.qemu_bitmaps_marked(),
        "no write may land before the claim"
    );
    let peeked = q.peek_qemu_bitmaps().unwrap();
    assert_eq!(peeked.len(), 1);
    assert!(peeked[0].words.is_ok(), "{:?}", peeked[0].words);
    assert_eq!(sha256(&img), before, "the open or the peek wrote the image");
    assert_eq!(
        qemu_bitmaps(&img),
        [("b".to_string(), vec!["auto".to_string()])]
    );
    let claimed = q.open_qemu_bitmaps().unwrap();
    assert!(claimed[0].words.is_ok(), "{:?}", claimed[0].words);
    assert!(q.qemu_bitmaps_marked());
    assert_eq!(
        qemu_bitmaps(&img),
        [(
            "b".to_string(),
            vec!["in-use".to_string(), "auto".to_string()]
        )]
    );
    drop(w);
    check_clean(&img);
}

/// A migration on shared storage, at the format layer: the destination
/// opens the image while the source holds it (QEMU's bitmaps in use
/// then), the source writes them back as it lets go, and the destination,
/// claiming the image, loads what the source wrote, not what it saw at
/// its open; its own write-back then frees the source's clusters, not
/// the ones the source already freed (`qemu-img check`: no leak, no
/// corruption). On the first version of the store the destination kept
/// the directory it saw at open and freed its clusters a second time.
#[test]
fn qemu_bitmaps_follow_a_handover() {
    use ringblk::bitmap::DirtyBitmap;

    let dir = scratch("qemu-bitmap-handover");
    let img = dir.join("disk.qcow2");
    let p = img.to_str().unwrap();
    let size = 16 * MIB;
    qemu_img(&["create", "-q", "-f", "qcow2", p, "16M"]);
    qemu_img(&["bitmap", "--add", p, "b"]);
    let as_set = |b: &DirtyBitmap| vec![stored("b", b)];
    let load = |l: Vec<ringblk::disk::qcow2::bitmaps::Loaded>| {
        assert_eq!(l.len(), 1);
        match l.into_iter().next().unwrap().words {
            Ok(w) => DirtyBitmap::from_words(size, 65536, w, true).unwrap(),
            Err(_) => {
                let b = DirtyBitmap::new(size, 65536).unwrap();
                b.set_inconsistent();
                b
            }
        }
    };

    let source = open(&img, true);
    let src = qcow(&*source);
    let a = load(src.open_qemu_bitmaps().unwrap());
    assert!(a.is_consistent());
    a.mark(MIB, 1);

    let dest = open(&img, true);
    let dst = qcow(&*dest);

    assert!(src.stage_qemu_bitmaps(as_set(&a)));
    src.invalidate().unwrap();
    drop(source);
    assert_eq!(
        qemu_bitmaps(&img),
        [("b".to_string(), vec!["auto".to_string()])]
    );

    let b = load(dst.open_qemu_bitmaps().unwrap());
    assert!(
        b.is_consistent(),
        "the destination did not load what the source wrote"
    );
    assert_eq!(b.dirty_extents(), [(MIB, 65536)]);
    b.mark(2 * MIB, 1);
    assert!(dst.stage_qemu_bitmaps(as_set(&b)));
    dst.invalidate().unwrap();
    drop(dest);
    let leaks = check_clean(&img);
    assert_eq!(leaks, 0);
    assert_eq!(qemu_dirty(&img, "b"), [(MIB, 65536), (2 * MIB, 65536)]);
}

/// A bitmaps extension broken behind the daemon's back (another program
/// wrote the image while ringblk had let it go): the next claim's load
/// fails in one line, and the image goes on serving.
#[test]
fn a_bitmaps_extension_broken_later_is_an_error_not_a_stop() {
    let dir = scratch("qemu-bitmap-broken-later");
    let img = dir.join("disk.qcow2");
    let p = img.to_str().unwrap();
    qemu_img(&["create", "-q", "-f", "qcow2", p, "4M"]);
    qemu_img(&["bitmap", "--add", p, "b"]);
    let w = open(&img, true);
    let q = qcow(&*w);
    assert_eq!(q.open_qemu_bitmaps().unwrap().len(), 1);
    q.invalidate().unwrap();
    // nb_bitmaps past QEMU's bound, written by "someone else".
    let bytes = std::fs::read(&img).unwrap();
    let be32 = |b: &[u8], at: usize| u32::from_be_bytes(b[at..at + 4].try_into().unwrap());
    let mut at = be32(&bytes, 100) as usize;
    while be32(&bytes, at) != 0x2385_2875 {
        at += 8 + (be32(&bytes, at + 4) as usize).next_multiple_of(8);
    }
    let f = std::fs::OpenOptions::new().write(true).open(&img).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&f, &70000u32.to_be_bytes(), at as u64 + 8).unwrap();
    let err = q.open_qemu_bitmaps().unwrap_err().to_string();
    assert!(
        err.contains("70000 bitmaps") && !err.contains('\n'),
        "{err}"
    );
    // QEMU refuses such an extension too: nothing takes a bitmap of it
    // for complete, so the daemon goes on serving.
    assert!(q.qemu_bitmaps_marked());
    let mut data = vec![0u8; 4096];
    fill(5, 0, &mut data);
    write(&*w, 0, &data).unwrap();
    flush(&*w).unwrap();
    let mut back = vec![0u8; 4096];
    read(&*w, 0, &mut back).unwrap();
    assert!(back == data);
}

/// The write-back under power loss: the image rebuilt as a crash at every
/// point of `bitmap_write::store` could leave it (each prefix of its
/// writes, and, as writes between two fdatasyncs may land in any order,
/// each single write of a group on top of the state synced before it).
/// In every state `qemu-img check` finds no corruption (leaks are
/// allowed), and a bitmap QEMU would trust (not in use) holds the old
/// bits or the new ones, never a mix.
#[test]
fn qemu_bitmap_write_back_is_crash_safe() {
    // 512-byte clusters: the write-back needs new refblocks too.
    write_back_crash_safe("qemu-bitmap-crash", "cluster_size=512", 256 * MIB, 9, false);
}

/// The same where the write-back needs a larger refcount table: 64-bit
/// refcounts and a disk whose metadata ends 37 KiB short of what the
/// image's one-cluster table covers (2 MiB of file), and a bitmap of
/// 16 KiB granules whose 63 KiB of bits go past it. The new table is
/// written with the new refblocks, the header pointed at it in one
/// write, the old one freed last. On the old code the write-back refused
/// ("the refcount table would need to grow").
#[test]
fn qemu_bitmap_write_back_growing_the_refcount_table_is_crash_safe() {
    write_back_crash_safe(
        "qemu-bitmap-crash-grow",
        "cluster_size=512,refcount_bits=64",
        7900 * MIB,
        14,
        true,
    );
}

/// [`qemu_bitmap_write_back_is_crash_safe`] on an image made with
/// `qemu-img create -o OPTS` of `size` bytes, whose bitmap `b` has
/// granules of 2^`gbits` bytes; `grows`: the refcount table must grow.
fn write_back_crash_safe(name: &str, opts: &str, size: u64, gbits: u8, grows: bool) {
    use ringblk::bitmap::DirtyBitmap;
    use ringblk::disk::qcow2::bitmap_write::{Op, Recorder, store_recorded};
    use ringblk::disk::qcow2::bitmaps::Bitmaps;
    use std::collections::BTreeMap;
    use std::os::unix::fs::FileExt;

    let dir = scratch(name);
    let g = 1u64 << gbits;
    let img = image_with_bitmap(&dir, opts, size, g, "b");
    let p = img.to_str().unwrap();
    if !grows {
        // (QEMU would grow the table itself for this, with room to spare.)
        run("qemu-io", &["-f", "qcow2", "-c", "write 1M 64k", p]);
    }
    let original = std::fs::read(&img).unwrap();

    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&img)
        .unwrap();
    let old = Bitmaps::load(&file).unwrap().unwrap();
    let mut read = |buf: &mut [u8], off: u64| file.read_exact_at(buf, off);
    let old_words = old.read_words(0, &mut read).unwrap();
    let b = DirtyBitmap::from_words(size, g, old_words.clone(), true).unwrap();
    for m in (0..size).step_by(MIB as usize) {
        b.mark(m, 1);
    }
    let fresh = DirtyBitmap::new(size, 65536).unwrap();
    fresh.mark(7 * MIB, 1);
    let new = vec![stored("b", &b), stored("fresh", &fresh)];
    let rec = Recorder::default();
    let before = reftable_clusters(&file);
    store_recorded(&file, 512, Some(&old), &new, &|_| false, Some(&rec)).unwrap();
    assert_eq!(
        reftable_clusters(&file) > before,
        grows,
        "the refcount table grew (or did not) unlike the test means"
    );
    drop(file);
    let ops = rec.ops.into_inner().unwrap();
    let syncs = ops.iter().filter(|o| matches!(o, Op::Sync)).count();
    assert!(syncs >= 3, "{syncs} fdatasyncs");
    let mut allowed: BTreeMap<&str, Vec<Vec<u64>>> = BTreeMap::new();
    allowed.insert("b", vec![old_words, new[0].words.clone()]);
    allowed.insert("fresh", vec![new[1].words.clone()]);

    let states = crash_states(&original, &ops);
    let crash = dir.join("crash.qcow2");
    let mut trusted = 0;
    for (i, s) in states.iter().enumerate() {
        std::fs::write(&crash, s).unwrap();
        let (corruptions, _leaks) = check(&crash);
        assert_eq!(corruptions, 0, "state {i} of {}: corrupt", states.len());
        let f = std::fs::File::open(&crash).unwrap();
        let Some(b) = Bitmaps::load(&f).unwrap() else {
            continue;
        };
        let mut read = |buf: &mut [u8], off: u64| f.read_exact_at(buf, off);
        for (k, e) in b.entries.iter().enumerate() {
            if e.in_use() {
                continue;
            }
            trusted += 1;
            let words = b.read_words(k, &mut read).unwrap();
            assert!(
                allowed[e.name.as_str()].contains(&words),
                "state {i}: bitmap {} trusted with bits that are neither old nor new",
                e.name
            );
        }
    }
    assert!(trusted > 0, "no state had a trusted bitmap (test is void)");
}

/// The first bitmap of an image without the bitmaps extension (a fresh
/// `qemu-img create -b base -F raw` overlay) and the removal of the last
/// one, through the format layer as the daemon drives it (staged, written
/// when the image is let go): the header cluster is rewritten with the
/// extension (the backing file name moved after it), QEMU lists the
/// bitmap, not in use, reads its bits over NBD, and `qemu-img check`
/// finds the image clean; imago, which rereads the header at every
/// release, goes on serving; a resize after it (imago writes the header's
/// first 72 bytes, with the backing file name's offset it read at open)
/// keeps the name QEMU finds; the removal leaves no bitmap, no leak, and
/// the guest's data. On the old code `stage_qemu_bitmaps` refused an
/// image without the extension (the daemon used sidecars) and the last
/// bitmap could not be removed.
#[test]
fn a_first_bitmap_adds_the_extension_and_the_last_removes_it() {
    use ringblk::bitmap::DirtyBitmap;

    let dir = scratch("qemu-bitmap-first");
    let size = 16 * MIB;
    let (img, _) = overlay_over(&dir, "raw", size);
    let name = ringblk_testkit::qemu_img::backing_filename(&img);
    assert_eq!(name, "base.raw");
    assert!(qemu_bitmaps(&img).is_empty());

    let as_set = |b: &DirtyBitmap| vec![stored("b", b)];
    let image = open(&img, true);
    let q = qcow(&*image);
    assert!(q.has_qemu_bitmaps());
    assert!(q.open_qemu_bitmaps().unwrap().is_empty());
    let mut data = vec![0u8; 65536];
    fill(7, MIB, &mut data);
    write(&*image, MIB, &data).unwrap();
    flush(&*image).unwrap();
    let b = DirtyBitmap::new(size, 65536).unwrap();
    b.mark(MIB, 65536);
    assert!(q.stage_qemu_bitmaps(as_set(&b)));
    q.invalidate().unwrap();
    assert_eq!(
        qemu_bitmaps(&img),
        [("b".to_string(), vec!["auto".to_string()])]
    );
    assert_eq!(ringblk_testkit::qemu_img::backing_filename(&img), name);
    assert_eq!(check_clean(&img), 0);
    assert_eq!(qemu_dirty(&img, "b"), [(MIB, 65536)]);

    // Served on after the release: imago reread the header.
    let mut more = vec![0u8; 65536];
    fill(8, 3 * MIB, &mut more);
    write(&*image, 3 * MIB, &more).unwrap();
    flush(&*image).unwrap();
    // A resize: imago writes the header's first bytes.
    q.grow(2 * size).unwrap();
    flush(&*image).unwrap();
    assert_eq!(
        ringblk_testkit::qemu_img::backing_filename(&img),
        name,
        "imago's header write moved the name back"
    );
    let b = b.resized(2 * size).unwrap();
    b.mark(3 * MIB, 65536);
    assert!(q.stage_qemu_bitmaps(as_set(&b)));
    q.invalidate().unwrap();
    assert_eq!(
        qemu_bitmaps(&img),
        [("b".to_string(), vec!["auto".to_string()])]
    );
    assert_eq!(ringblk_testkit::qemu_img::backing_filename(&img), name);
    assert_eq!(check_clean(&img), 0);
    // (The grown part is dirty: `DirtyBitmap::resized`.)
    assert_eq!(
        qemu_dirty(&img, "b"),
        [(MIB, 65536), (3 * MIB, 65536), (size, size)]
    );

    // The last bitmap removed: the extension goes.
    assert_eq!(q.open_qemu_bitmaps().unwrap().len(), 1);
    assert!(q.stage_qemu_bitmaps(Vec::new()));
    q.invalidate().unwrap();
    drop(image);
    assert!(qemu_bitmaps(&img).is_empty());
    assert_eq!(ringblk_testkit::qemu_img::backing_filename(&img), name);
    assert_eq!(check_clean(&img), 0);
    let p = img.to_str().unwrap();
    let mut expect = vec![0u8; 65536];
    fill(7, MIB, &mut expect);
    let back = dir.join("back.raw");
    qemu_img(&["convert", "-O", "raw", p, back.to_str().unwrap()]);
    let all = std::fs::read(&back).unwrap();
    assert_eq!(all.len() as u64, 2 * size);
    assert!(all[MIB as usize..MIB as usize + 65536] == expect[..]);
    assert!(all[3 * MIB as usize..3 * MIB as usize + 65536] == more[..]);
}

/// The states a crash during the recorded `ops` may leave a file that was
/// `original`: each prefix of them, and, as writes between two
/// fdatasyncs may land in any order, each single write of a group on top
/// of the state synced before it.
fn crash_states(original: &[u8], ops: &[ringblk::disk::qcow2::bitmap_write::Op]) -> Vec<Vec<u8>> {
    use ringblk::disk::qcow2::bitmap_write::Op;
    let apply = |state: &mut Vec<u8>, op: &Op| match op {
        Op::Write { offset, data } => {
            let end = *offset as usize + data.len();
            if state.len() < end {
                state.resize(end, 0);
            }
            state[*offset as usize..end].copy_from_slice(data);
        }
        Op::SetLen(len) => state.resize(*len as usize, 0),
        Op::Sync => {}
    };
    let mut states = Vec::new();
    let mut state = original.to_vec();
    let mut synced = original.to_vec();
    states.push(state.clone());
    let mut group: Vec<&Op> = Vec::new();
    for op in ops {
        apply(&mut state, op);
        states.push(state.clone());
        if matches!(op, Op::Sync) {
            for single in &group {
                let mut s = synced.clone();
                for o in &group {
                    if matches!(o, Op::SetLen(_)) {
                        apply(&mut s, o);
                    }
                }
                apply(&mut s, single);
                states.push(s);
            }
            group.clear();
            synced = state.clone();
        } else {
            group.push(op);
        }
    }
    states
}

/// Adding the bitmaps extension to a fresh overlay's header and removing
/// it again, under power loss (as `qemu_bitmap_write_back_is_crash_safe`):
/// in every state a crash may leave, `qemu-img check` finds no corruption
/// (leaks allowed), QEMU finds the backing file, and the bitmap, when
/// QEMU lists it, is either absent or complete (the bits written). The
/// header is written once, after everything it points to is durable; the
/// old clusters are freed only once the header without the extension is.
#[test]
fn adding_and_removing_the_extension_is_crash_safe() {
    use ringblk::bitmap::DirtyBitmap;
    use ringblk::disk::qcow2::bitmap_write::{Op, Recorder, Stored, store_recorded};
    use ringblk::disk::qcow2::bitmaps::Bitmaps;

    let dir = scratch("qemu-bitmap-ext-crash");
    let size = 16 * MIB;
    let (img, _) = overlay_over(&dir, "raw", size);
    run(
        "qemu-io",
        &["-f", "qcow2", "-c", "write 1M 64k", img.to_str().unwrap()],
    );
    let name = ringblk_testkit::qemu_img::backing_filename(&img);
    let b = DirtyBitmap::new(size, 65536).unwrap();
    b.mark(MIB, 65536);
    let new = [stored("b", &b)];
    let crash = dir.join("crash.qcow2");
    let mut in_states = [0usize; 2];
    for (round, adding) in [true, false].into_iter().enumerate() {
        let original = std::fs::read(&img).unwrap();
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&img)
            .unwrap();
        let old = Bitmaps::load(&file).unwrap();
        assert_eq!(old.is_some(), !adding);
        let rec = Recorder::default();
        let set: &[Stored] = if adding { &new } else { &[] };
        store_recorded(&file, 65536, old.as_ref(), set, &|_| false, Some(&rec)).unwrap();
        drop(file);
        let ops = rec.ops.into_inner().unwrap();
        assert!(ops.iter().filter(|o| matches!(o, Op::Sync)).count() >= 2);
        for (i, s) in crash_states(&original, &ops).iter().enumerate() {
            std::fs::write(&crash, s).unwrap();
            let (corruptions, _leaks) = check(&crash);
            assert_eq!(corruptions, 0, "round {round}, state {i}: corrupt");
            assert_eq!(
                ringblk_testkit::qemu_img::backing_filename(&crash),
                name,
                "round {round}, state {i}"
            );
            let listed = qemu_bitmaps(&crash);
            if !listed.is_empty() {
                in_states[round] += 1;
                assert_eq!(listed, [("b".to_string(), vec!["auto".to_string()])]);
                assert_eq!(
                    qemu_dirty(&crash, "b"),
                    [(MIB, 65536)],
                    "round {round}, state {i}"
                );
            }
        }
        // Each round reached its end state.
        assert_eq!(qemu_bitmaps(&img).is_empty(), !adding);
        assert_eq!(check_clean(&img), 0);
    }
    assert!(in_states[0] > 0 && in_states[1] > 0, "{in_states:?}");
}

/// A handover (as in a migration on shared storage) of a fresh overlay
/// whose first bitmap the source adds: the source's write-back moves the
/// backing file name after the new extension; the destination, opened
/// before, claims the image and resizes it (imago writes the header's
/// first 72 bytes, with the name's offset it read at its open). QEMU
/// still finds the backing file, and the bitmap. Without the patch taken
/// at each claim, the destination wrote the old offset back.
#[test]
fn a_handover_after_the_extension_was_added_keeps_the_backing_name() {
    use ringblk::bitmap::DirtyBitmap;

    let dir = scratch("qemu-bitmap-first-handover");
    let size = 16 * MIB;
    let (img, _) = overlay_over(&dir, "raw", size);
    let name = ringblk_testkit::qemu_img::backing_filename(&img);
    let source = open(&img, true);
    let dest = open(&img, true);
    let src = qcow(&*source);
    assert!(src.open_qemu_bitmaps().unwrap().is_empty());
    let b = DirtyBitmap::new(size, 65536).unwrap();
    b.mark(0, 1);
    assert!(src.stage_qemu_bitmaps(vec![stored("b", &b)]));
    src.invalidate().unwrap();
    drop(source);
    assert_eq!(ringblk_testkit::qemu_img::backing_filename(&img), name);

    let dst = qcow(&*dest);
    dst.claim().unwrap();
    assert_eq!(dst.open_qemu_bitmaps().unwrap().len(), 1);
    dst.grow(2 * size).unwrap();
    flush(&*dest).unwrap();
    assert_eq!(
        ringblk_testkit::qemu_img::backing_filename(&img),
        name,
        "the old offset was written back"
    );
    drop(dest);
    check(&img);
}
