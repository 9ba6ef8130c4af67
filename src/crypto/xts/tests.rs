//! AES-XTS against IEEE 1619's vectors, against Python's `cryptography`
//! (OpenSSL's XTS, one data unit per call, its tweak computed there from
//! the byte offset), and against what cryptsetup puts in a LUKS2 header.

use std::process::{Command, Stdio};

use super::*;

fn hex(s: &str) -> Vec<u8> {
    assert!(s.len().is_multiple_of(2));
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

/// Distinct bytes for keys and data, from a seed.
fn bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

// IEEE 1619-2007 Annex B: vectors 1 and 2 (32-byte data units), 4
// (AES-128, 512 bytes) and 10 (AES-256, 512 bytes, data unit 0xff).
const V4_KEY: &str = "2718281828459045235360287471352631415926535897932384626433832795";
const V4_CT: &str = "27a7479befa1d476489f308cd4cfa6e2a96e4bbe3208ff25287dd3819616e89c\
c78cf7f5e543445f8333d8fa7f56000005279fa5d8b5e4ad40e736ddb4d35412\
328063fd2aab53e5ea1e0a9f332500a5df9487d07a5c92cc512c8866c7e860ce\
93fdf166a24912b422976146ae20ce846bb7dc9ba94a767aaef20c0d61ad0265\
5ea92dc4c4e41a8952c651d33174be51a10c421110e6d81588ede82103a252d8\
a750e8768defffed9122810aaeb99f9172af82b604dc4b8e51bcb08235a6f434\
1332e4ca60482a4ba1a03b3e65008fc5da76b70bf1690db4eae29c5f1badd03c\
5ccf2a55d705ddcd86d449511ceb7ec30bf12b1fa35b913f9f747a8afd1b130e\
94bff94effd01a91735ca1726acd0b197c4e5b03393697e126826fb6bbde8ecc\
1e08298516e2c9ed03ff3c1b7860f6de76d4cecd94c8119855ef5297ca67e9f3\
e7ff72b1e99785ca0a7e7720c5b36dc6d72cac9574c8cbbc2f801e23e56fd344\
b07f22154beba0f08ce8891e643ed995c94d9a69c9f1b5f499027a78572aeebd\
74d20cc39881c213ee770b1010e4bea718846977ae119f7a023ab58cca0ad752\
afe656bb3c17256a9f6e9bf19fdd5a38fc82bbe872c5539edb609ef4f79c203e\
bb140f2e583cb2ad15b4aa5b655016a8449277dbd477ef2c8d6c017db738b18d\
eb4a427d1923ce3ff262735779a418f20a282df920147beabe421ee5319d0568";
const V10_KEY: &str = "2718281828459045235360287471352662497757247093699959574966967627\
3141592653589793238462643383279502884197169399375105820974944592";
const V10_CT: &str = "1c3b3a102f770386e4836c99e370cf9bea00803f5e482357a4ae12d414a3e63b\
5d31e276f8fe4a8d66b317f9ac683f44680a86ac35adfc3345befecb4bb188fd\
5776926c49a3095eb108fd1098baec70aaa66999a72a82f27d848b21d4a741b0\
c5cd4d5fff9dac89aeba122961d03a757123e9870f8acf1000020887891429ca\
2a3e7a7d7df7b10355165c8b9a6d0a7de8b062c4500dc4cd120c0f7418dae3d0\
b5781c34803fa75421c790dfe1de1834f280d7667b327f6c8cd7557e12ac3a0f\
93ec05c52e0493ef31a12d3d9260f79a289d6a379bc70c50841473d1a8cc81ec\
583e9645e07b8d9670655ba5bbcfecc6dc3966380ad8fecb17b6ba02469a020a\
84e18e8f84252070c13e9f1f289be54fbc481457778f616015e1327a02b140f1\
505eb309326d68378f8374595c849d84f4c333ec4423885143cb47bd71c5edae\
9be69a2ffeceb1bec9de244fbe15992b11b77c040f12bd8f6a975a44a0f90c29\
a9abc3d4d893927284c58754cce294529f8614dcd2aba991925fedc4ae74ffac\
6e333b93eb4aff0479da9a410e4450e0dd7ae4c6e2910900575da401fc07059f\
645e8b7e9bfdef33943054ff84011493c27b3429eaedb4ed5376441a77ed4385\
1ad77f16f541dfd269d50d6a5f14fb0aab1cbb4c1550be97f7ab4066193c4caa\
773dad38014bd2092fa755c824bb5e54c4f36ffda9fcea70b9c6e693e148c151";

/// The vectors' 512-byte plaintext: 00..ff twice.
fn pt512() -> Vec<u8> {
    (0..512).map(|i| i as u8).collect()
}

#[test]
fn ieee_1619_32_byte_units() {
    // (key, data unit number, plaintext, ciphertext)
    let vectors = [
        (
            "0000000000000000000000000000000000000000000000000000000000000000",
            0,
            "0000000000000000000000000000000000000000000000000000000000000000",
            "917cf69ebd68b2ec9b9fe9a3eadda692cd43d2f59598ed858c02c2652fbf922e",
        ),
        (
            "1111111111111111111111111111111122222222222222222222222222222222",
            0x33_3333_3333,
            "4444444444444444444444444444444444444444444444444444444444444444",
            "c454185e6a16936e39334038acef838bfb186fff7480adc4289382ecd6d394f0",
        ),
    ];
    for (key, unit, pt, ct) in vectors {
        let xts = Xts::new(&hex(key)).unwrap();
        let mut buf = hex(pt);
        xts.crypt(Dir::Encrypt, 32, 1, unit, &mut buf);
        assert_eq!(buf, hex(ct), "vector with key {key}");
        xts.crypt(Dir::Decrypt, 32, 1, unit, &mut buf);
        assert_eq!(buf, hex(pt), "vector with key {key}, decrypted");
    }
}

#[test]
fn ieee_1619_512_byte_sectors() {
    let layout = SectorLayout::new(512, IvUnit::Bytes512, 0).unwrap();
    // (key, data unit number, ciphertext); both units are sectors here.
    for (key, unit, ct) in [(V4_KEY, 0u64, V4_CT), (V10_KEY, 0xff, V10_CT)] {
        let xts = Xts::new(&hex(key)).unwrap();
        let mut buf = pt512();
        xts.encrypt(&layout, unit * 512, &mut buf).unwrap();
        assert_eq!(buf, hex(ct), "{}-bit key", xts.key_bits());
        xts.decrypt(&layout, unit * 512, &mut buf).unwrap();
        assert_eq!(buf, pt512(), "{}-bit key, decrypted", xts.key_bits());
    }
}

#[test]
fn bad_keys_layouts_and_buffers_are_refused() {
    for n in [0, 16, 31, 48, 63, 65, 128] {
        assert_eq!(Xts::new(&vec![7; n]).unwrap_err(), XtsError::KeyLength(n));
    }
    for size in [0, 16, 1024, 2048, 8192] {
        assert_eq!(
            SectorLayout::new(size, IvUnit::Sector, 0).unwrap_err(),
            XtsError::SectorSize(size)
        );
    }
    let xts = Xts::new(&bytes(1, 64)).unwrap();
    let layout = SectorLayout::new(4096, IvUnit::Bytes512, 0).unwrap();
    let mut buf = vec![0u8; 8192];
    // Not on a sector, or not whole sectors: refused, and left alone.
    for (offset, len) in [(512, 4096), (0, 4096 + 512), (0, 100)] {
        let err = xts.encrypt(&layout, offset, &mut buf[..len]).unwrap_err();
        assert_eq!(
            err,
            XtsError::Unaligned {
                offset,
                len,
                sector_size: 4096
            }
        );
        let mut segs = [&mut buf[..len]];
        assert!(xts.decrypt_segments(&layout, offset, &mut segs).is_err());
    }
    assert!(buf.iter().all(|&b| b == 0));
    // An empty buffer is whole sectors (none).
    xts.encrypt(&layout, 0, &mut []).unwrap();
}

#[test]
fn iv_rules() {
    let l = SectorLayout::new(4096, IvUnit::Bytes512, 0).unwrap();
    assert_eq!(l.iv_at(3 * 4096), 24);
    let l = SectorLayout::new(4096, IvUnit::Sector, 0).unwrap();
    assert_eq!(l.iv_at(3 * 4096), 3);
    let l = SectorLayout::new(512, IvUnit::Sector, 10).unwrap();
    assert_eq!(l.iv_at(3 * 512), 13);
    let l = SectorLayout::new(512, IvUnit::Bytes512, u64::MAX).unwrap();
    assert_eq!(l.iv_at(512), 0, "plain64 wraps");
}

/// The oracle: Python's `cryptography` transforms `data`, sector by
/// sector, each sector's tweak computed there from its byte offset.
const ORACLE: &str = r#"
import sys
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
key = bytes.fromhex(sys.argv[1])
size, unit, iv_offset, offset = (int(a) for a in sys.argv[2:6])
decrypt = sys.argv[6] == "decrypt"
data = sys.stdin.buffer.read()
out = bytearray()
for i in range(0, len(data), size):
    iv = ((offset + i) // unit + iv_offset) % 2**64
    c = Cipher(algorithms.AES(key), modes.XTS(iv.to_bytes(16, "little")))
    c = c.decryptor() if decrypt else c.encryptor()
    out += c.update(data[i:i + size]) + c.finalize()
sys.stdout.buffer.write(out)
"#;

#[allow(clippy::too_many_arguments)]
fn oracle(
    key: &[u8],
    size: usize,
    unit: usize,
    iv_offset: u64,
    offset: u64,
    how: &str,
    data: &[u8],
) -> Vec<u8> {
    use std::io::Write;
    let key: String = key.iter().map(|b| format!("{b:02x}")).collect();
    let mut child = Command::new("python3")
        .args(["-c", ORACLE, &key])
        .args([size, unit].map(|n| n.to_string()))
        .args([iv_offset, offset].map(|n| n.to_string()))
        .arg(how)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("running python3");
    child.stdin.take().unwrap().write_all(data).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "the Python oracle failed");
    out.stdout
}

/// Splits `buf` at `cuts` (lengths, the rest last), as an iovec would.
fn split<'a>(mut buf: &'a mut [u8], cuts: &[usize]) -> Vec<&'a mut [u8]> {
    let mut segs = Vec::new();
    for &n in cuts {
        let (a, b) = buf.split_at_mut(n.min(buf.len()));
        segs.push(a);
        buf = b;
    }
    segs.push(buf);
    segs
}

#[test]
fn python_cryptography_agrees() {
    // Python's cryptography and cryptsetup (the kit installs them).
    ringblk_testkit::luks::need_tools();
    // Segment lengths that split sectors anywhere, empty ones included.
    let cuts = [1, 15, 0, 17, 4000, 100, 511, 3, 0, 9000, 4096, 4096, 7];
    let mut case = 0;
    for key_len in [32, 64] {
        for size in [512, 4096] {
            for (unit, unit_bytes) in [(IvUnit::Bytes512, 512), (IvUnit::Sector, size)] {
                for iv_offset in [0, 0x1234_5678_9abc, u64::MAX - 5] {
                    case += 1;
                    let key = bytes(case, key_len);
                    let xts = Xts::new(&key).unwrap();
                    let layout = SectorLayout::new(size, unit, iv_offset).unwrap();
                    // Odd counts: more sectors than one batch of tweaks
                    // and a last batch of blocks that is not full.
                    let len = if size == 512 { 71 * 512 } else { 11 * 4096 };
                    let offset = 5 * size as u64;
                    let plain = bytes(case + 100, len);
                    let what = format!(
                        "{}-bit key, {size}-byte sectors, {unit:?}, IV offset {iv_offset:#x}",
                        xts.key_bits()
                    );
                    let want = oracle(&key, size, unit_bytes, iv_offset, offset, "encrypt", &plain);

                    let mut buf = plain.clone();
                    xts.encrypt(&layout, offset, &mut buf).unwrap();
                    assert!(buf == want, "{what}: encrypt differs from the oracle");
                    xts.decrypt(&layout, offset, &mut buf).unwrap();
                    assert!(buf == plain, "{what}: decrypt does not invert encrypt");

                    let mut buf = plain.clone();
                    xts.encrypt_segments(&layout, offset, &mut split(&mut buf, &cuts))
                        .unwrap();
                    assert!(buf == want, "{what}: segmented encrypt differs");
                    xts.decrypt_segments(&layout, offset, &mut split(&mut buf, &cuts))
                        .unwrap();
                    assert!(buf == plain, "{what}: segmented decrypt differs");

                    // And the oracle's own decryption of random bytes.
                    let noise = bytes(case + 200, len);
                    let want = oracle(&key, size, unit_bytes, iv_offset, offset, "decrypt", &noise);
                    let mut buf = noise.clone();
                    xts.decrypt(&layout, offset, &mut buf).unwrap();
                    assert!(buf == want, "{what}: decrypt differs from the oracle");
                }
            }
        }
    }
}

/// Runs cryptsetup, panicking with its output if it fails; returns stdout.
fn cryptsetup(args: &[&str]) -> String {
    let out = Command::new("cryptsetup")
        .args(args)
        .output()
        .expect("running cryptsetup");
    assert!(
        out.status.success(),
        "cryptsetup {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// A LUKS2 image with 4096-byte sectors as cryptsetup makes it: its
/// header says the payload's offset and sector size and gives back the
/// volume key; a sector this module encrypts there under the LUKS2 IV rule
/// (offset in 512-byte units, no `iv_large_sectors`) decrypts in the
/// oracle to the plaintext. dm-crypt is not needed, so cryptsetup's
/// `open` is not run: the oracle stands for it.
#[test]
fn luks2_4096_byte_sectors_use_512_byte_ivs() {
    // Python's cryptography and cryptsetup (the kit installs them).
    ringblk_testkit::luks::need_tools();
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("luks2.img");
    std::fs::File::create(&img)
        .unwrap()
        .set_len(32 << 20)
        .unwrap();
    let key = bytes(7, 64);
    let key_file = dir.path().join("volume.key");
    std::fs::write(&key_file, &key).unwrap();
    let pass = dir.path().join("pass");
    std::fs::write(&pass, "a known passphrase").unwrap();
    let (img_s, key_s, pass_s) = (
        img.to_str().unwrap(),
        key_file.to_str().unwrap(),
        pass.to_str().unwrap(),
    );
    cryptsetup(&[
        "luksFormat",
        "--type",
        "luks2",
        "--cipher",
        "aes-xts-plain64",
        "--key-size",
        "512",
        "--sector-size",
        "4096",
        "--pbkdf",
        "pbkdf2",
        "--pbkdf-force-iterations",
        "1000",
        "--volume-key-file",
        key_s,
        "--key-file",
        pass_s,
        "--batch-mode",
        img_s,
    ]);
    let meta: serde_json::Value =
        serde_json::from_str(&cryptsetup(&["luksDump", "--dump-json-metadata", img_s])).unwrap();
    let seg = &meta["segments"]["0"];
    assert_eq!(seg["encryption"], "aes-xts-plain64");
    let sector_size = seg["sector_size"].as_u64().unwrap() as usize;
    assert_eq!(sector_size, 4096);
    let data_offset: u64 = seg["offset"].as_str().unwrap().parse().unwrap();
    let iv_tweak: u64 = seg["iv_tweak"].as_str().unwrap().parse().unwrap();
    // The volume key as cryptsetup gives it back from the keyslot.
    let dump = cryptsetup(&[
        "luksDump",
        "--dump-volume-key",
        "--key-file",
        pass_s,
        "--batch-mode",
        img_s,
    ]);
    let dumped: String = dump
        .split_once("MK dump:")
        .expect("a volume key in luksDump's output")
        .1
        .split_whitespace()
        .collect();
    assert_eq!(hex(&dumped), key);

    // Payload sectors 3 and 4 (IVs 24 and 32), written where dm-crypt
    // would put them.
    let xts = Xts::new(&key).unwrap();
    let layout = SectorLayout::new(sector_size, IvUnit::Bytes512, iv_tweak).unwrap();
    let at = 3 * sector_size as u64;
    let plain = bytes(8, 2 * sector_size);
    let mut buf = plain.clone();
    xts.encrypt(&layout, at, &mut buf).unwrap();
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new().write(true).open(&img).unwrap();
        f.write_all_at(&buf, data_offset + at).unwrap();
    }
    let on_disk = {
        use std::os::unix::fs::FileExt;
        let mut b = vec![0; buf.len()];
        std::fs::File::open(&img)
            .unwrap()
            .read_exact_at(&mut b, data_offset + at)
            .unwrap();
        b
    };
    let back = oracle(&key, sector_size, 512, iv_tweak, at, "decrypt", &on_disk);
    assert!(
        back == plain,
        "the oracle does not decrypt our LUKS2 sectors"
    );
    // Sector-unit IVs (iv_large_sectors) would give other bytes.
    let other = oracle(
        &key,
        sector_size,
        sector_size,
        iv_tweak,
        at,
        "decrypt",
        &on_disk,
    );
    assert!(other != plain);
}

/// The batching of [`Pass::run`] for the batch sizes of `aes`'s other
/// backends (this machine's CPU picks one): AES-NI's 8 blocks, VAES-256's
/// 30 and VAES-512's 64, and 1, each block then through the cipher one by
/// one; all must give what `encrypt` gives (checked above against the
/// oracle).
#[test]
fn every_batch_size_gives_the_same_bytes() {
    use aes::cipher::consts::{U1, U8, U30, U64};

    fn encrypt_in_batches<P: ArraySize>(key: &[u8], size: usize, iv: u64, buf: &mut [u8]) {
        let data = Aes256::new_from_slice(&key[..32]).unwrap();
        let tweak = Aes256::new_from_slice(&key[32..]).unwrap();
        let tweaks: Vec<Block> = (0..buf.len() / size)
            .map(|i| {
                let iv = iv + (i * size / 512) as u64;
                let mut b = Array::from((iv as u128).to_le_bytes());
                tweak.encrypt_block(&mut b);
                b
            })
            .collect();
        let pass = Pass {
            buf,
            tweaks: &tweaks,
            blocks_per_sector: size / BLOCK,
        };
        pass.run::<P>(|batch| {
            for b in batch.iter_mut() {
                data.encrypt_block(b);
            }
        });
    }

    let key = bytes(42, 64);
    let xts = Xts::new(&key).unwrap();
    for (size, sectors) in [(512, 9), (4096, 3)] {
        let layout = SectorLayout::new(size, IvUnit::Bytes512, 0).unwrap();
        let plain = bytes(43, size * sectors);
        let mut want = plain.clone();
        xts.encrypt(&layout, 4096, &mut want).unwrap();
        type Run = fn(&[u8], usize, u64, &mut [u8]);
        let runs: [(&str, Run); 4] = [
            ("1", encrypt_in_batches::<U1>),
            ("8", encrypt_in_batches::<U8>),
            ("30", encrypt_in_batches::<U30>),
            ("64", encrypt_in_batches::<U64>),
        ];
        for (p, run) in runs {
            let mut buf = plain.clone();
            run(&key, size, 8, &mut buf);
            assert!(buf == want, "{size}-byte sectors in batches of {p} blocks");
        }
    }
}
