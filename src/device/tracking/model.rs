//! The backup state machine against a model of what its bitmap must hold
//! (issue 29): random sequences of writes, `backup start`, `backup stop`,
//! `backup stop --failed`, two starts at once, a clean restart and a
//! kill -9 (the device forgotten, never stopped: what a killed process
//! leaves in the sidecar is what its mapping put in the page cache), on
//! a raw image with its bitmap in a sidecar.
//!
//! The model: every granule written since the last `backup stop` that
//! ended well must be in the bitmap, which must be consistent (a sidecar
//! keeps its bits across a kill -9 of the same boot); after such a stop
//! the bitmap holds exactly what was written since that backup's instant;
//! a backup's export holds exactly what the bitmap held at its instant.

use std::collections::BTreeSet;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Barrier};

use super::*;
use crate::bitmap::sidecar::SidecarStore;
use crate::device::{Device, DeviceSpec};

const G: u64 = 64 << 10;
const SIZE: u64 = 256 * G;

/// A small deterministic generator (xorshift64*): the seed names a case.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// A device on `dir/disk.img` with its sidecars and backups in `dir`, the
/// image held (as a running ring holds it).
fn device(dir: &Path) -> Device {
    let image = dir.join("disk.img");
    let store = SidecarStore::for_image(&image, None).unwrap();
    let backups = BackupSpec {
        dir: dir.join("backups"),
        dir_fd: File::open(dir.join("backups")).unwrap(),
        image: File::open(&image).unwrap(),
        store: tempfile::tempfile_in(dir).unwrap(),
    };
    let d = Device::new(DeviceSpec {
        capacity_sectors: SIZE >> 9,
        bitmaps: Ok(Box::new(store)),
        backups: Ok(backups),
        ..DeviceSpec::default()
    })
    .unwrap();
    d.claim_image().unwrap();
    d
}

fn write(d: &Device, off: u64, len: u64) {
    d.tracking().targets().1.before_write(off, len);
}

fn granules(off: u64, len: u64) -> impl Iterator<Item = u64> {
    off / G..(off + len).div_ceil(G)
}

fn bits(b: &DirtyBitmap) -> BTreeSet<u64> {
    b.dirty_extents()
        .into_iter()
        .flat_map(|(o, l)| granules(o, l))
        .collect()
}

/// The live bitmap `b` of `d`.
fn live(d: &Device) -> Arc<DirtyBitmap> {
    d.tracking.lock().live("b").unwrap()
}

/// The running backup's exported bits.
fn exported(d: &Device) -> BTreeSet<u64> {
    let inner = d.tracking.lock();
    let (_, frozen) = inner.backup.as_ref().unwrap().frozen.as_ref().unwrap();
    bits(frozen)
}

struct Model {
    /// Written since the last backup that ended well.
    must: BTreeSet<u64>,
    /// Written since the running backup's instant, and what the bitmap
    /// held then.
    running: Option<(BTreeSet<u64>, BTreeSet<u64>)>,
}

fn check(d: &Device, m: &Model, what: &str) {
    let b = live(d);
    assert!(b.is_consistent(), "{what}: inconsistent");
    let have = bits(&b);
    assert!(
        m.must.is_subset(&have),
        "{what}: the bitmap lacks {:?}",
        m.must.difference(&have).collect::<Vec<_>>()
    );
    if let Some((_, at_start)) = &m.running {
        assert_eq!(&exported(d), at_start, "{what}: the export");
    }
}

fn run(seed: u64) {
    let dir = tempfile::tempdir().unwrap();
    let dir = dir.path();
    std::fs::create_dir(dir.join("backups")).unwrap();
    File::create(dir.join("disk.img"))
        .unwrap()
        .set_len(SIZE)
        .unwrap();
    let mut d = device(dir);
    d.bitmap_add("b", G).unwrap();
    let mut rng = Rng(seed | 1);
    let mut m = Model {
        must: BTreeSet::new(),
        running: None,
    };
    let mut sockets = 0;
    let mut socket = || {
        sockets += 1;
        PathBuf::from(format!("s{sockets}.nbd"))
    };
    for step in 0..60 {
        let op = rng.below(100);
        let what = format!("seed {seed} step {step} op {op}");
        match op {
            0..50 => {
                let off = rng.below(SIZE / 512) * 512;
                let len = ((1 + rng.below(3 * G / 512)) * 512).min(SIZE - off);
                write(&d, off, len);
                m.must.extend(granules(off, len));
                if let Some((since, _)) = &mut m.running {
                    since.extend(granules(off, len));
                }
            }
            50..62 => {
                let started = d.backup_start(&socket(), Some("b"));
                match &m.running {
                    Some(_) => assert!(
                        matches!(started, Err(TrackingError::BackupRunning(_))),
                        "{what}: a second start: {:?}",
                        started.map(|i| i.socket)
                    ),
                    None => {
                        started.unwrap();
                        m.running = Some((BTreeSet::new(), m.must.clone()));
                    }
                }
            }
            62..67 => {
                // Two at once: one starts, unless one runs already.
                let barrier = Barrier::new(2);
                let (a, b) = (socket(), socket());
                let go = |p: &PathBuf| {
                    barrier.wait();
                    d.backup_start(p, Some("b")).is_ok()
                };
                let (x, y) = std::thread::scope(|s| {
                    let x = s.spawn(|| go(&a));
                    let y = s.spawn(|| go(&b));
                    (x.join().unwrap(), y.join().unwrap())
                });
                let want = usize::from(m.running.is_none());
                assert_eq!(usize::from(x) + usize::from(y), want, "{what}");
                if m.running.is_none() {
                    m.running = Some((BTreeSet::new(), m.must.clone()));
                }
            }
            67..77 => {
                let stopped = d.backup_stop(false);
                match m.running.take() {
                    Some((since, _)) => {
                        stopped.unwrap();
                        assert_eq!(bits(&live(&d)), since, "{what}: after a good stop");
                        m.must = since;
                    }
                    None => assert!(stopped.is_err(), "{what}"),
                }
            }
            77..85 => {
                let stopped = d.backup_stop(true);
                assert_eq!(stopped.is_ok(), m.running.take().is_some(), "{what}");
            }
            85..92 => {
                // A clean stop of the daemon: a running backup ends as
                // failed, the bitmap is written out.
                d.stop_tracking();
                d.release_image();
                drop(d);
                d = device(dir);
                m.running = None;
            }
            _ => {
                // kill -9: nothing of the device's runs any more; the
                // sidecar holds what its mapping wrote.
                std::mem::forget(d);
                d = device(dir);
                m.running = None;
            }
        }
        check(&d, &m, &what);
    }
    d.stop_tracking();
    d.release_image();
}

#[test]
fn a_bitmap_holds_every_change_since_the_last_good_backup() {
    for seed in 1..=24 {
        run(seed * 0x9e37_79b9);
    }
}
