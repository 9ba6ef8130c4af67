//! Opening images that cryptsetup and qemu-img made, with cryptsetup's
//! `luksDump --dump-volume-key` as the oracle for the volume key; and
//! refusing unsupported and hostile headers, each with one line.
//!
//! The KDF costs are forced tiny (`--pbkdf-force-iterations`,
//! `--pbkdf-memory 32`) so the tests are fast; cryptsetup-bin comes from
//! scripts/format-deps.sh when missing (a test never skips for want of it).

use std::fs::File;
use std::path::{Path, PathBuf};

use ringblk_testkit::luks::{self, PASS, cryptsetup, key_file, qemu_img_create};
use sha2::{Digest as _, Sha256};

use super::*;

/// `cryptsetup luksFormat` on a new 17 MiB file, passphrase [`PASS`].
fn format(dir: &Path, name: &str, args: &[&str]) -> PathBuf {
    luks::format(dir, name, 17 << 20, args)
}

/// The volume key, as cryptsetup dumps it.
fn dumped_key(dir: &Path, img: &Path) -> Vec<u8> {
    luks::dump(dir, img).0
}

fn open_path(img: &Path, pass: &[u8]) -> Result<Unlocked> {
    let f = File::open(img).unwrap();
    let len = f.metadata().unwrap().len();
    open(
        &FileRegion {
            file: &f,
            base: 0,
            len,
        },
        pass,
    )
}

/// Opens with "pass", checks the key against cryptsetup's, and that a
/// wrong passphrase fails with one line.
fn opens_as_cryptsetup_says(dir: &Path, img: &Path) -> Unlocked {
    let u = open_path(img, PASS).unwrap_or_else(|e| panic!("{}: {e}", img.display()));
    assert_eq!(u.key.as_bytes(), dumped_key(dir, img), "{}", img.display());
    assert_eq!(u.key.len(), u.segment.key_bytes);
    let e = open_path(img, b"wrong").unwrap_err();
    assert!(matches!(e, LuksError::WrongPassphrase { .. }), "{e}");
    let line = e.to_string();
    assert!(
        line.contains("wrong passphrase") && !line.contains('\n'),
        "{line}"
    );
    u
}

const PBKDF2: &[&str] = &["--pbkdf", "pbkdf2", "--pbkdf-force-iterations", "1000"];
const ARGON2ID: &[&str] = &[
    "--pbkdf",
    "argon2id",
    "--pbkdf-memory",
    "32",
    "--pbkdf-force-iterations",
    "4",
    "--pbkdf-parallel",
    "1",
];

fn args<'a>(a: &[&'a str], b: &[&'a str]) -> Vec<&'a str> {
    [a, b].concat()
}

#[test]
fn luks2_pbkdf2_512_byte_sectors_512_bit_key() {
    let dir = tempfile::tempdir().unwrap();
    let img = format(
        dir.path(),
        "a",
        &args(
            &[
                "--type",
                "luks2",
                "--sector-size",
                "512",
                "--key-size",
                "512",
            ],
            PBKDF2,
        ),
    );
    let u = opens_as_cryptsetup_says(dir.path(), &img);
    assert_eq!(
        u.segment,
        Segment {
            offset: 16 << 20,
            size: None,
            sector_size: 512,
            iv_tweak: 0,
            key_bytes: 64
        }
    );
    assert_eq!(u.keyslot, 0);
}

#[test]
fn luks2_argon2id_4096_byte_sectors_256_bit_key() {
    let dir = tempfile::tempdir().unwrap();
    let img = format(
        dir.path(),
        "a",
        &args(
            &[
                "--type",
                "luks2",
                "--sector-size",
                "4096",
                "--key-size",
                "256",
            ],
            ARGON2ID,
        ),
    );
    let h = read_header(&std::fs::read(&img).unwrap()[..]).unwrap();
    assert_eq!(
        h.keyslot_kdfs(),
        [(
            0,
            Kdf::Argon2 {
                variant: Argon2Variant::Argon2id,
                time: 4,
                memory_kib: 32,
                lanes: 1
            }
        )]
    );
    let u = opens_as_cryptsetup_says(dir.path(), &img);
    assert_eq!((u.segment.sector_size, u.segment.key_bytes), (4096, 32));
}

#[test]
fn luks2_argon2i_and_pbkdf2_hashes() {
    let dir = tempfile::tempdir().unwrap();
    let argon2i: Vec<&str> = ARGON2ID
        .iter()
        .map(|a| if *a == "argon2id" { "argon2i" } else { a })
        .collect();
    let img = format(dir.path(), "i", &args(&["--type", "luks2"], &argon2i));
    opens_as_cryptsetup_says(dir.path(), &img);
    for hash in ["sha1", "sha512"] {
        let img = format(
            dir.path(),
            hash,
            &args(&["--type", "luks2", "--hash", hash], PBKDF2),
        );
        let h = read_header(&std::fs::read(&img).unwrap()[..]).unwrap();
        assert_eq!(
            h.keyslot_kdfs()[0].1,
            Kdf::Pbkdf2 {
                hash: Hash::parse(hash).unwrap(),
                iterations: 1000
            }
        );
        opens_as_cryptsetup_says(dir.path(), &img);
    }
}

#[test]
fn luks2_second_keyslot_opens_with_its_own_passphrase() {
    let dir = tempfile::tempdir().unwrap();
    let img = format(dir.path(), "a", &args(&["--type", "luks2"], PBKDF2));
    let old = key_file(dir.path(), PASS);
    let new = key_file(dir.path(), b"other");
    cryptsetup(
        &[
            &[
                "luksAddKey",
                "--batch-mode",
                "--key-file",
                old.to_str().unwrap(),
            ][..],
            PBKDF2,
            &[img.to_str().unwrap(), new.to_str().unwrap()],
        ]
        .concat(),
    );
    let u = open_path(&img, b"other").unwrap();
    assert_eq!(u.keyslot, 1);
    assert_eq!(u.key.as_bytes(), dumped_key(dir.path(), &img));
    match open_path(&img, b"neither").unwrap_err() {
        LuksError::WrongPassphrase { tried } => assert_eq!(tried, 2),
        e => panic!("{e}"),
    }
}

#[test]
fn luks1_from_cryptsetup() {
    let dir = tempfile::tempdir().unwrap();
    for (name, extra) in [
        ("k512", &["--key-size", "512", "--hash", "sha256"][..]),
        ("k256", &["--key-size", "256", "--hash", "sha1"][..]),
    ] {
        let img = format(
            dir.path(),
            name,
            &args(
                &["--type", "luks1", "--pbkdf-force-iterations", "1000"],
                extra,
            ),
        );
        let u = opens_as_cryptsetup_says(dir.path(), &img);
        assert_eq!(u.segment.sector_size, 512);
        assert_eq!(
            u.segment.key_bytes * 8,
            if name == "k512" { 512 } else { 256 }
        );
        assert_eq!(
            read_header(&std::fs::read(&img).unwrap()[..])
                .unwrap()
                .version,
            Version::Luks1
        );
    }
}

#[test]
fn luks1_from_qemu_img() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("q.luks");
    qemu_img_create(&[
        "create",
        "-q",
        "-f",
        "luks",
        "--object",
        "secret,id=s0,data=pass",
        "-o",
        "key-secret=s0,iter-time=10",
        img.to_str().unwrap(),
        "1M",
    ]);
    let u = opens_as_cryptsetup_says(dir.path(), &img);
    assert_eq!((u.segment.sector_size, u.segment.key_bytes), (512, 64));
    let len = std::fs::metadata(&img).unwrap().len();
    assert_eq!(u.segment.offset, len - (1 << 20));
}

/// The LUKS header inside a qcow2 file (`encrypt.format=luks`): a region
/// named by the header extension 0x0537be77, opened in place.
#[test]
fn luks_in_qcow2_from_qemu_img() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("q.qcow2");
    qemu_img_create(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "--object",
        "secret,id=s0,data=pass",
        "-o",
        "encrypt.format=luks,encrypt.key-secret=s0,encrypt.iter-time=10",
        img.to_str().unwrap(),
        "1M",
    ]);
    let data = std::fs::read(&img).unwrap();
    let be32 = |at: usize| u32::from_be_bytes(data[at..at + 4].try_into().unwrap());
    let be64 = |at: usize| u64::from_be_bytes(data[at..at + 8].try_into().unwrap());
    let mut at = be32(100) as usize; // header_length (v3)
    let (base, len) = loop {
        let (kind, n) = (be32(at), be32(at + 4) as usize);
        assert_ne!(kind, 0, "no crypt header extension");
        if kind == 0x0537_be77 {
            break (be64(at + 8), be64(at + 16));
        }
        at += 8 + n.div_ceil(8) * 8;
    };
    let f = File::open(&img).unwrap();
    let u = open(
        &FileRegion {
            file: &f,
            base,
            len,
        },
        PASS,
    )
    .unwrap();
    assert_eq!(u.segment.key_bytes, 64);
    // The region holds header and keyslots only; the data is in clusters.
    assert_eq!(u.segment.offset, len);
    // cryptsetup reads the same region as a LUKS1 image of its own.
    let region = dir.path().join("region");
    std::fs::write(&region, &data[base as usize..(base + len) as usize]).unwrap();
    assert_eq!(u.key.as_bytes(), dumped_key(dir.path(), &region));
    assert!(matches!(
        open(
            &FileRegion {
                file: &f,
                base,
                len
            },
            b"nope"
        ),
        Err(LuksError::WrongPassphrase { .. })
    ));
}

fn refused(bytes: &[u8]) -> String {
    let e = open(bytes, PASS).expect_err("refused");
    let s = e.to_string();
    assert!(!s.contains('\n'), "{s}");
    s
}

#[test]
fn unsupported_ciphers_are_refused_naming_what_is_supported() {
    let dir = tempfile::tempdir().unwrap();
    for ty in ["luks1", "luks2"] {
        let img = format(
            dir.path(),
            ty,
            &args(&["--type", ty, "--cipher", "aes-cbc-essiv:sha256"], PBKDF2),
        );
        let e = refused(&std::fs::read(&img).unwrap());
        assert!(
            e.contains("aes-cbc-essiv:sha256") && e.contains("supported: aes-xts-plain64"),
            "{e}"
        );
    }
    // cryptsetup checks a non-AES cipher through device-mapper, which a
    // machine without dm-crypt lacks: serpent is written into a header
    // cryptsetup made, as it would have written it.
    let img = format(dir.path(), "s1", &args(&["--type", "luks1"], &[]));
    let mut b = std::fs::read(&img).unwrap();
    b[8..40].fill(0);
    b[8..15].copy_from_slice(b"serpent");
    let e = refused(&b);
    assert!(
        e.contains("serpent-xts-plain64") && e.contains("supported: aes-xts"),
        "{e}"
    );

    let img = format(dir.path(), "s2", &args(&["--type", "luks2"], PBKDF2));
    let b = std::fs::read(&img).unwrap();
    let e = refused(&edit_json(&b, |j| {
        j["segments"]["0"]["encryption"] = "serpent-xts-plain64".into();
    }));
    assert!(
        e.contains("serpent-xts-plain64") && e.contains("supported: aes-xts"),
        "{e}"
    );
    // Integrity (AEAD) segments: cryptsetup formats them only through
    // dm-integrity, so the segment gets the object it would carry.
    let e = refused(&edit_json(&b, |j| {
        j["segments"]["0"]["integrity"] = serde_json::json!({"type": "hmac(sha256)", "journal_encryption": "none", "journal_integrity": "none"});
    }));
    assert!(
        e.contains("integrity") && e.contains("supported: aes-xts"),
        "{e}"
    );
    // The untouched header opens: the edits above are what was refused.
    assert!(open(&b[..], PASS).is_ok());
    assert!(open(&edit_json(&b, |_| {})[..], PASS).is_ok());
}

/// Rewrites the JSON of both LUKS2 header copies and their checksums.
fn edit_json(img: &[u8], f: impl Fn(&mut serde_json::Value)) -> Vec<u8> {
    let mut out = img.to_vec();
    let hdr_size = u64::from_be_bytes(img[8..16].try_into().unwrap()) as usize;
    for at in [0, hdr_size] {
        let area = &img[at + 4096..at + hdr_size];
        let end = area.iter().position(|&c| c == 0).unwrap();
        let mut j: serde_json::Value = serde_json::from_slice(&area[..end]).unwrap();
        f(&mut j);
        let text = serde_json::to_vec(&j).unwrap();
        set_json(&mut out, at, &text);
    }
    out
}

/// Puts `text` (which may be anything) into the JSON area of the copy at
/// `at` and fixes its checksum.
fn set_json(img: &mut [u8], at: usize, text: &[u8]) {
    let hdr_size = u64::from_be_bytes(img[at + 8..at + 16].try_into().unwrap()) as usize;
    let area = &mut img[at + 4096..at + hdr_size];
    assert!(text.len() < area.len(), "JSON of {} bytes", text.len());
    area.fill(0);
    area[..text.len()].copy_from_slice(text);
    fix_checksum(img, at);
}

fn fix_checksum(img: &mut [u8], at: usize) {
    let hdr_size = u64::from_be_bytes(img[at + 8..at + 16].try_into().unwrap()) as usize;
    img[at + 448..at + 512].fill(0);
    let sum = Sha256::digest(&img[at..at + hdr_size]);
    img[at + 448..at + 480].copy_from_slice(&sum);
}

#[test]
fn luks2_damaged_primary_opens_from_the_secondary() {
    let dir = tempfile::tempdir().unwrap();
    let img = format(dir.path(), "a", &args(&["--type", "luks2"], PBKDF2));
    let good = std::fs::read(&img).unwrap();
    let key = dumped_key(dir.path(), &img);

    let mut b = good.clone();
    b[5000] ^= 1; // in the primary's JSON area
    assert_eq!(open(&b[..], PASS).unwrap().key.as_bytes(), key);
    let mut b = good.clone();
    b[..6].fill(0); // the primary's magic gone
    assert_eq!(open(&b[..], PASS).unwrap().key.as_bytes(), key);

    // Both damaged: refused.
    let mut b = good.clone();
    b[5000] ^= 1;
    b[16384 + 5000] ^= 1;
    let e = refused(&b);
    assert!(e.contains("checksum mismatch"), "{e}");

    // The valid copy with the higher seqid wins: the secondary, edited
    // into a wrong cipher, is the one read.
    let mut b = edit_json(&good, |j| {
        j["segments"]["0"]["encryption"] = "twofish-xts-plain64".into();
    });
    b[..32768 / 2].copy_from_slice(&good[..16384]);
    let seq = u64::from_be_bytes(b[16384 + 16..16384 + 24].try_into().unwrap());
    b[16384 + 16..16384 + 24].copy_from_slice(&(seq + 1).to_be_bytes());
    fix_checksum(&mut b, 16384);
    assert!(refused(&b).contains("twofish"));
}

#[test]
fn hostile_luks2_headers_are_refused_with_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let img = format(dir.path(), "a", &args(&["--type", "luks2"], PBKDF2));
    let good = std::fs::read(&img).unwrap();
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("binary header truncated", good[..1000].to_vec()),
        ("JSON area truncated", good[..10000].to_vec()),
        ("starts past the end of the image", good[..1 << 20].to_vec()),
        ("not a LUKS image", vec![0u8; 65536]),
        (
            "more than 32 entries",
            edit_json(&good, |j| {
                for i in 0..33 {
                    j["keyslots"][i.to_string()] = j["keyslots"]["0"].clone();
                }
            }),
        ),
        (
            "asks too much: 4000000000 PBKDF2 iterations",
            edit_json(&good, |j| {
                j["keyslots"]["0"]["kdf"]["iterations"] = 4_000_000_000u64.into()
            }),
        ),
        (
            "digest iterations",
            edit_json(&good, |j| {
                j["digests"]["0"]["iterations"] = 200_000_000.into()
            }),
        ),
        (
            "Argon2 memory 8388608 KiB",
            edit_json(&good, |j| {
                j["keyslots"]["0"]["kdf"] = serde_json::json!({"type": "argon2id", "time": 4, "memory": 8388608, "cpus": 1, "salt": "AAAAAAAAAAAAAAAAAAAAAA=="});
            }),
        ),
        (
            "Argon2 time cost 100000",
            edit_json(&good, |j| {
                j["keyslots"]["0"]["kdf"] = serde_json::json!({"type": "argon2id", "time": 100000, "memory": 32, "cpus": 1, "salt": "AAAAAAAAAAAAAAAAAAAAAA=="});
            }),
        ),
        (
            "1000000000 anti-forensic stripes",
            edit_json(&good, |j| {
                j["keyslots"]["0"]["af"]["stripes"] = 1_000_000_000.into()
            }),
        ),
        (
            "key of 384 bits",
            edit_json(&good, |j| j["keyslots"]["0"]["key_size"] = 48.into()),
        ),
        (
            "invalid type: string",
            edit_json(&good, |j| j["keyslots"]["0"]["key_size"] = "64".into()),
        ),
        (
            "outside the keyslots area",
            edit_json(&good, |j| {
                j["keyslots"]["0"]["area"]["offset"] = "4096".into()
            }),
        ),
        (
            "overlap",
            edit_json(&good, |j| {
                let mut k1 = j["keyslots"]["0"].clone();
                k1["area"]["offset"] = "163840".into();
                j["keyslots"]["1"] = k1;
                j["digests"]["0"]["keyslots"] = serde_json::json!(["0", "1"]);
            }),
        ),
        (
            "goes past the end of the image",
            edit_json(&good, |j| j["segments"]["0"]["size"] = "1073741824".into()),
        ),
        (
            "reencryption",
            edit_json(&good, |j| {
                j["config"]["requirements"] =
                    serde_json::json!({"mandatory": ["online-reencrypt-v2"]});
            }),
        ),
        (
            "sector size 1024",
            edit_json(&good, |j| j["segments"]["0"]["sector_size"] = 1024.into()),
        ),
    ];
    for (want, bytes) in cases {
        let e = refused(&bytes);
        assert!(e.contains(want), "want {want:?}, got {e}");
    }

    // JSON text that serde_json would not build: nested by hand, and
    // larger than the area, and a header size past the 4 MiB limit.
    let mut b = good.clone();
    let text = format!("{{\"tokens\":{}{}}}", "[".repeat(5000), "]".repeat(5000));
    set_json(&mut b, 0, text.as_bytes());
    set_json(&mut b, 16384, text.as_bytes());
    assert!(refused(&b).contains("nests 5001 deep"));
    let mut b = good.clone();
    b[8..16].copy_from_slice(&(8u64 << 20).to_be_bytes());
    b[16384 + 8..16384 + 16].copy_from_slice(&(8u64 << 20).to_be_bytes());
    let e = refused(&b);
    assert!(e.contains("header size 8388608"), "{e}");
    let mut b = good.clone();
    set_json(&mut b, 0, b"{\"keyslots\":");
    set_json(&mut b, 16384, b"{\"keyslots\":");
    assert!(refused(&b).contains("JSON: EOF"));
}

#[test]
fn hostile_luks1_headers_are_refused_with_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let img = format(
        dir.path(),
        "a",
        &["--type", "luks1", "--pbkdf-force-iterations", "1000"],
    );
    let good = std::fs::read(&img).unwrap();
    let edit = |at: usize, v: u32| {
        let mut b = good.clone();
        b[at..at + 4].copy_from_slice(&v.to_be_bytes());
        b
    };
    let slot0 = 208;
    for (want, bytes) in [
        ("truncated", good[..500].to_vec()),
        (
            "asks too much: 4294967295 PBKDF2",
            edit(slot0 + 4, u32::MAX),
        ),
        (
            "4294967295 anti-forensic stripes",
            edit(slot0 + 44, u32::MAX),
        ),
        ("outside the keyslots area", edit(slot0 + 40, 0)),
        ("past the end of the image", edit(104, u32::MAX)),
        ("key of 8000 bits", edit(108, 1000)),
        ("digest iterations 0", edit(164, 0)),
        ("neither active nor inactive", edit(slot0, 7)),
        ("overlap", edit(slot0 + 48 + 40, 8)), // slot 1 at slot 0's sectors...
    ] {
        let mut bytes = bytes;
        if want == "overlap" {
            // ...and active.
            bytes[slot0 + 48..slot0 + 56].copy_from_slice(&good[slot0..slot0 + 8]);
        }
        let e = refused(&bytes);
        assert!(e.contains(want), "want {want:?}, got {e}");
    }
    assert!(open(&good[..], PASS).is_ok());
}
