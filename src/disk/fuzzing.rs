//! The logic of the `qcow2` fuzz target (fuzz/fuzz_targets/qcow2.rs),
//! here so that tests/layers/fuzz_corpus.rs replays its corpus under a plain
//! `cargo test`.
//!
//! The input is an image file: the first byte holds flags (bit 0: open it
//! writable; bit 1: an L2 log comes first, its length in 4 bytes
//! little-endian, then its bytes, with the image's identity and this
//! boot's id written over its header so that it is read), the rest is the
//! file. It is opened as qcow2 with a chain
//! bound of 1 (a backing file named in the input is never opened: the
//! input may name any host file), then the whole guest range is mapped
//! and resolved in a few pieces, compressed data read, and, when writable,
//! one write and one write-zeroes done. The promises checked beyond "no
//! panic": an open failure is one line; the pieces of a range cover it
//! exactly, in order; a data piece names a file of the chain and does not
//! overflow; a write never maps to a backing file. The bitmaps
//! extension's parser (qcow2/bitmaps.rs) also reads every input, writable
//! or not: its errors are one line too; and, writable, a bitmap is
//! written into the image and removed again (the header rewrite of
//! qcow2/bitmap_write.rs, around the input's own extensions).

use std::io::Write;

use super::{Dir, Format, FormatError, Image, OpenOptions, Piece, Where};

/// What one input led to (for the corpus test's coverage check).
#[derive(Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Refused at open; the message.
    Refused(String),
    /// Opened; how many requests failed and succeeded.
    Served { ok: usize, failed: usize },
}

fn check_pieces(img: &dyn Image, offset: u64, len: u64, dir: Dir, pieces: &[Piece]) {
    let mut pos = offset;
    for p in pieces {
        assert_eq!(
            p.guest, pos,
            "pieces of {len}@{offset} skip or overlap: {pieces:?}"
        );
        assert!(p.len > 0, "empty piece: {pieces:?}");
        pos = p.guest.checked_add(p.len).expect("piece overflows");
        if let Where::Data { file, offset } = p.at {
            assert!(
                file < img.files().len(),
                "piece names file {file}: {pieces:?}"
            );
            assert!(
                offset.checked_add(p.len).is_some(),
                "host range overflows: {p:?}"
            );
            if dir == Dir::Write {
                assert_eq!(file, 0, "a write mapped to a backing file: {p:?}");
            }
        }
        if dir == Dir::Write {
            assert!(p.at != Where::Zero, "a write mapped to zeroes: {p:?}");
        }
    }
    assert_eq!(pos, offset + len, "pieces of {len}@{offset} end at {pos}");
}

/// Runs one input. Panics only on a broken promise.
pub fn run_one(data: &[u8]) -> Outcome {
    let (flags, image) = data.split_first().map_or((0, &[][..]), |(f, r)| (*f, r));
    let (log, image) = match image {
        [a, b, c, d, rest @ ..] if flags & 2 != 0 => {
            let n = (u32::from_le_bytes([*a, *b, *c, *d]) as usize).min(rest.len());
            (Some(rest[..n].to_vec()), &rest[n..])
        }
        _ => (None, image),
    };
    let mut read = |buf: &mut [u8], off: u64| {
        let at = usize::try_from(off).ok().filter(|&a| a <= image.len());
        match at.and_then(|a| image.get(a..a.checked_add(buf.len())?)) {
            Some(src) => {
                buf.copy_from_slice(src);
                Ok(())
            }
            None => Err(std::io::ErrorKind::UnexpectedEof.into()),
        }
    };
    match super::qcow2::bitmaps::parse(&mut read, image.len() as u64) {
        Err(msg) => assert!(!msg.contains('\n'), "multi-line bitmaps error: {msg}"),
        Ok(Some(b)) => {
            // The bits too, where they are small (a bitmap may be 512 MiB).
            for i in (0..b.entries.len()).filter(|&i| b.bits_len(i) <= 1 << 20) {
                if let Err(msg) = b.read_words(i, &mut read) {
                    assert!(!msg.contains('\n'), "multi-line bitmaps error: {msg}");
                }
            }
        }
        Ok(None) => {}
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("image.qcow2");
    let file = std::fs::File::create(&path).expect("creating the input");
    (&file).write_all(image).expect("writing the input");
    let log_path = super::qcow2::l2log::path_for(&path);
    if let Some(mut log) = log {
        use std::os::unix::fs::MetadataExt;
        let meta = file.metadata().expect("stat");
        if log.len() >= 76 {
            log[24..32].copy_from_slice(&meta.dev().to_le_bytes());
            log[32..40].copy_from_slice(&meta.ino().to_le_bytes());
            log[40..76].copy_from_slice(&crate::host::boot_id().expect("boot id"));
        }
        std::fs::write(&log_path, &log).expect("writing the log");
    }
    let options = OpenOptions {
        writable: flags & 1 != 0,
        max_chain: 1,
        map_cache_entries: 64,
        l2_log: Some(log_path),
        ..OpenOptions::default()
    };
    let img = match super::open(&path, Format::Qcow2, &options) {
        Ok(img) => img,
        Err(e) => {
            let msg = e.to_string();
            assert!(!msg.contains('\n'), "multi-line open error: {msg}");
            return Outcome::Refused(msg);
        }
    };
    let (mut ok, mut failed) = (0, 0);
    let mut tally = |r: Result<(), FormatError>| match r {
        Ok(()) => ok += 1,
        Err(_) => failed += 1,
    };
    // As a daemon taking the image lock: the L2 log written in.
    if let Some(q) = img.as_qcow2() {
        tally(q.claim().map(|_| ()));
    }
    let size = img.size();
    // A few ranges across the disk (bounded work for absurd sizes).
    let step = (size / 4).max(512);
    let mut offset = 0u64;
    for _ in 0..4 {
        if offset >= size {
            break;
        }
        let len = (size - offset).min(256 << 10);
        for dir in [Dir::Read, Dir::Write] {
            let mut pieces = Vec::new();
            img.map(offset, len, dir, &mut pieces);
            check_pieces(&*img, offset, len, dir, &pieces);
        }
        let mut pieces = Vec::new();
        let r = img.resolve(offset, len, Dir::Read, &mut pieces).map(|_| ());
        if r.is_ok() {
            check_pieces(&*img, offset, len, Dir::Read, &pieces);
            for p in &pieces {
                if p.at == Where::Slow {
                    let mut buf = vec![0u8; p.len.min(1 << 20) as usize];
                    tally(img.read_slow(p.guest, &mut buf));
                }
            }
        }
        tally(r);
        offset = offset.saturating_add(step);
    }
    if img.writable() && size >= 4096 {
        let mut pieces = Vec::new();
        let r = img.resolve(0, 4096, Dir::Write, &mut pieces);
        if let Ok(ticket) = &r {
            check_pieces(&*img, 0, 4096, Dir::Write, &pieces);
            if let Some(t) = ticket {
                tally(img.commit(*t, false));
            }
        }
        tally(r.map(|_| ()));
        tally(img.write_zeroes(0, size.min(1 << 20), true).map(|_| ()));
        tally(img.flush());
        // The bitmap directory written, as `ctl bitmap add` and `remove`
        // write it: the header cluster rewritten around whatever
        // extensions the input has, then the extension removed again.
        // Bounded: the bits of a 64 GiB disk at 64 KiB are 128 KiB.
        if let (Some(q), true) = (img.as_qcow2(), size <= 1 << 36) {
            let granules = size.div_ceil(1 << 16);
            let one = super::qcow2::bitmap_write::Stored {
                name: "fuzz".to_string(),
                granularity_bits: 16,
                auto: true,
                consistent: false,
                words: vec![0; granules.div_ceil(64) as usize],
            };
            tally(q.store_qemu_bitmaps_now(vec![one]));
            tally(q.store_qemu_bitmaps_now(Vec::new()));
        }
    }
    Outcome::Served { ok, failed }
}
