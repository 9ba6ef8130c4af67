use std::fs::OpenOptions;
use std::sync::atomic::AtomicBool;
use std::thread;

use super::*;

const MIB: u64 = 1 << 20;

/// Every 8-byte word holds its offset xor `seed`.
fn pattern(seed: u64, off: u64, len: usize) -> Vec<u8> {
    (0..len as u64 / 8)
        .flat_map(|i| ((off + i * 8) ^ seed).to_le_bytes())
        .collect()
}

/// A small xorshift, so the tests need no crate.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// An image that waits a little before each read, which widens the window
/// between a view's check of a cluster and its read of the image.
struct Slow(FileImage);
impl Image for Slow {
    fn size(&self) -> u64 {
        self.0.size()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        thread::sleep(std::time::Duration::from_micros(200));
        self.0.read_at(buf, offset)
    }
    fn allocation(&self, offset: u64, max_len: u64) -> io::Result<(u64, u32)> {
        self.0.allocation(offset, max_len)
    }
}

fn image_with(dir: &Path, size: u64, seed: u64) -> (std::path::PathBuf, Arc<dyn Image>) {
    let path = dir.join("disk.img");
    std::fs::write(&path, pattern(seed, 0, size as usize)).unwrap();
    let image: Arc<dyn Image> = Arc::new(FileImage::open(&path).unwrap());
    (path, image)
}

/// A guest thread overwrites the image at random (each write through
/// `before_write` first) while reader threads read the view at random
/// ranges: every read returns the content of the instant the view was
/// taken, and so does a full read afterwards.
#[test]
fn the_view_stays_at_its_instant_under_concurrent_writes() {
    let dir = tempfile::tempdir().unwrap();
    let size = 8 * MIB + 4096; // a partial last cluster
    let (path, _) = image_with(dir.path(), size, 0xA);
    let image: Arc<dyn Image> = Arc::new(Slow(FileImage::open(&path).unwrap()));
    let store = Arc::new(CbwStore::new(image, dir.path(), DEFAULT_CLUSTER).unwrap());
    let stop = Arc::new(AtomicBool::new(false));
    let guest = {
        let (store, stop, path) = (store.clone(), stop.clone(), path.clone());
        thread::spawn(move || {
            let f = OpenOptions::new().write(true).open(&path).unwrap();
            let mut rng = Rng(7);
            let mut n = 0;
            while !stop.load(Ordering::Relaxed) || n < 200 {
                let off = rng.next() % (size / 512) * 512;
                let len = ((rng.next() % 256 + 1) * 512).min(size - off);
                store.before_write(off, len);
                f.write_all_at(&pattern(0xB, off, len as usize), off)
                    .unwrap();
                n += 1;
            }
            n
        })
    };
    let readers: Vec<_> = (0..2)
        .map(|t| {
            let store = store.clone();
            thread::spawn(move || {
                let mut rng = Rng(100 + t);
                for _ in 0..1000 {
                    let off = rng.next() % (size / 8) * 8;
                    let len = ((rng.next() % (96 << 10)) / 8 * 8 + 8).min(size - off) as usize;
                    let mut buf = vec![0u8; len];
                    store.read(off, &mut buf).unwrap();
                    assert!(buf == pattern(0xA, off, len), "view changed at {off}+{len}");
                }
            })
        })
        .collect();
    for r in readers {
        r.join().unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    let writes = guest.join().unwrap();
    let mut all = vec![0u8; size as usize];
    store.read(0, &mut all).unwrap();
    assert!(all == pattern(0xA, 0, size as usize), "final view differs");
    let stats = store.stats();
    assert!(stats.copied_clusters > 10, "{writes} writes, {stats:?}");
    // The image itself took the writes.
    assert!(std::fs::read(&path).unwrap() != pattern(0xA, 0, size as usize));
}

/// Two writers to the same clusters: one copies, the other waits, and
/// the old data is copied exactly once.
#[test]
fn one_copy_per_cluster_under_racing_writers() {
    let dir = tempfile::tempdir().unwrap();
    let size = 4 * MIB;
    let (_path, image) = image_with(dir.path(), size, 1);
    let store = Arc::new(CbwStore::new(image, dir.path(), DEFAULT_CLUSTER).unwrap());
    let ts: Vec<_> = (0..4)
        .map(|_| {
            let store = store.clone();
            thread::spawn(move || store.before_write(0, size))
        })
        .collect();
    for t in ts {
        t.join().unwrap();
    }
    assert_eq!(store.stats().copied_clusters, size / DEFAULT_CLUSTER);
    assert_eq!(store.stats().stored_bytes, size);
}

/// Holes stay holes in the view, even after the guest writes into them,
/// and read as zeroes; the copy of a zero cluster costs no store space.
#[test]
fn allocation_of_the_view() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sparse.img");
    let f = std::fs::File::create(&path).unwrap();
    f.set_len(4 * MIB).unwrap();
    f.write_all_at(&[7u8; 4096 * 16], MIB).unwrap(); // data at 1 MiB
    f.sync_all().unwrap();
    let image: Arc<dyn Image> = Arc::new(FileImage::open(&path).unwrap());
    let store = CbwStore::new(image, dir.path(), DEFAULT_CLUSTER).unwrap();
    let hz = STATE_HOLE | STATE_ZERO;
    assert_eq!(store.allocation(0, 4 * MIB).unwrap(), (MIB, hz));
    assert_eq!(store.allocation(MIB, 4 * MIB).unwrap().1, 0);

    // The guest writes into the hole at 2 MiB and over the data.
    store.before_write(2 * MIB, 4096);
    f.write_all_at(&[9u8; 4096], 2 * MIB).unwrap();
    store.before_write(MIB, 4096);
    f.write_all_at(&[9u8; 4096], MIB).unwrap();
    f.sync_all().unwrap();
    assert_eq!(store.stats().copied_clusters, 2);
    assert_eq!(
        store.stats().stored_bytes,
        DEFAULT_CLUSTER,
        "the zero cluster is not stored"
    );
    assert_eq!(
        store.allocation(2 * MIB, MIB).unwrap(),
        (DEFAULT_CLUSTER, hz)
    );
    assert_eq!(store.allocation(MIB, MIB).unwrap(), (DEFAULT_CLUSTER, 0));
    let mut buf = vec![1u8; 8192];
    store.read(2 * MIB, &mut buf).unwrap();
    assert!(buf.iter().all(|&b| b == 0));
    store.read(MIB, &mut buf).unwrap();
    assert!(buf.iter().all(|&b| b == 7));
}

/// An image whose reads fail after the view is taken.
struct Failing(FileImage, AtomicBool);
impl Image for Failing {
    fn size(&self) -> u64 {
        self.0.size()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        if self.1.load(Ordering::Relaxed) {
            return Err(io::Error::from_raw_os_error(libc::EIO));
        }
        self.0.read_at(buf, offset)
    }
    fn allocation(&self, offset: u64, max_len: u64) -> io::Result<(u64, u32)> {
        self.0.allocation(offset, max_len)
    }
}

/// A failed copy lets the guest's write go on, and fails the view's reads
/// of what it could not keep.
#[test]
fn a_failed_copy_fails_the_view_not_the_guest() {
    let dir = tempfile::tempdir().unwrap();
    let (path, _) = image_with(dir.path(), MIB, 3);
    let failing = Arc::new(Failing(
        FileImage::open(&path).unwrap(),
        AtomicBool::new(false),
    ));
    let store = CbwStore::new(failing.clone(), dir.path(), DEFAULT_CLUSTER).unwrap();
    failing.1.store(true, Ordering::Relaxed);
    store.before_write(0, 4096); // returns, does not hang
    store.before_write(0, 4096); // already "copied": returns at once
    assert!(store.has_failed());
    let mut buf = vec![0u8; 4096];
    let e = store.read(0, &mut buf).unwrap_err();
    assert!(e.to_string().contains("incomplete"), "{e}");
}

#[test]
fn bad_cluster_sizes_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (_p, image) = image_with(dir.path(), MIB, 0);
    for bad in [0, 512, 3 << 12, 128 << 20] {
        assert!(
            CbwStore::new(image.clone(), dir.path(), bad).is_err(),
            "{bad}"
        );
    }
}

/// The view's export: the bitmap context answers from the frozen bits,
/// base:allocation from the store.
#[test]
fn the_view_exports_the_frozen_bitmap() {
    let dir = tempfile::tempdir().unwrap();
    let (_p, image) = image_with(dir.path(), 4 * MIB, 0);
    let store = Arc::new(CbwStore::new(image, dir.path(), DEFAULT_CLUSTER).unwrap());
    let live = DirtyBitmap::new(4 * MIB, DEFAULT_CLUSTER).unwrap();
    live.mark(MIB, 1);
    let frozen = Arc::new(live.copy());
    live.mark(0, 1); // after the instant: not in the export
    let view = View::new(store, Some(("nightly".into(), frozen)));
    assert_eq!(view.bitmaps(), ["nightly"]);
    let ctx = MetaContext::DirtyBitmap("nightly".into());
    assert_eq!(view.block_status(&ctx, 0, 4 * MIB).unwrap(), (MIB, 0));
    assert_eq!(
        view.block_status(&ctx, MIB, 4 * MIB).unwrap(),
        (DEFAULT_CLUSTER, STATE_DIRTY)
    );
    assert_eq!(
        view.block_status(&MetaContext::Allocation, 0, 4 * MIB)
            .unwrap()
            .1,
        0
    );
}

/// A qcow2 overlay (256 KiB clusters) over a raw base of 4 MiB, virtual
/// size 8 MiB: the view reads the guest's disk through the chain, keeps
/// the instant across a partial write that allocates and copies up, and
/// a discard, and `base:allocation` says data over the base, a hole past
/// it. The store's cluster is the overlay's.
#[test]
fn a_qcow2_view_reads_the_chain_and_keeps_the_instant() {
    use crate::disk::{Dir, Live, OpenOptions as DiskOptions, Where};
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().join("base.raw");
    std::fs::write(&base, pattern(1, 0, (4 * MIB) as usize)).unwrap();
    let top = dir.path().join("top.qcow2");
    ringblk_testkit::qemu_img::qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-o",
        "cluster_size=262144",
        "-F",
        "raw",
        "-b",
        base.to_str().unwrap(),
        top.to_str().unwrap(),
        &(8 * MIB).to_string(),
    ]);
    let live = Arc::new(
        Live::open(
            &top,
            crate::disk::Format::Qcow2,
            DiskOptions::default(),
            false,
            None,
        )
        .unwrap(),
    );
    let disk = Arc::new(Reader::new(live.clone(), 8 * MIB));
    let mut at_start = pattern(1, 0, (4 * MIB) as usize);
    at_start.resize((8 * MIB) as usize, 0);
    let mut buf = vec![0xffu8; (8 * MIB) as usize];
    disk.read_at(&mut buf, 0).unwrap();
    assert!(buf == at_start, "the disk through the chain");
    assert_eq!(disk.allocation(0, 8 * MIB).unwrap(), (4 * MIB, 0));
    assert_eq!(
        disk.allocation(4 * MIB, 8 * MIB).unwrap(),
        (4 * MIB, STATE_HOLE | STATE_ZERO)
    );

    let cluster = Reader::cluster(&live, DEFAULT_CLUSTER);
    assert_eq!(cluster, 256 << 10);
    let cbw = CbwStore::new(disk.clone(), dir.path(), cluster).unwrap();
    // A guest write of 4 KiB at 68 KiB, as the engine does it: the copy
    // first, then the format allocates (copying the rest of the cluster
    // up from the base), then the data.
    let w = 68 << 10;
    cbw.before_write(w, 4096);
    let served = live.current();
    let mut pieces = Vec::new();
    let ticket = served
        .image
        .resolve(w, 4096, Dir::Write, &mut pieces)
        .unwrap();
    let Where::Data { file: 0, offset } = pieces[0].at else {
        panic!("{pieces:?}");
    };
    served
        .qcow2()
        .unwrap()
        .data_write(&pattern(2, w, 4096), offset)
        .unwrap();
    if let Some(t) = ticket {
        served.image.commit(t, false).unwrap();
    }
    // A discard of the second cluster, copied first.
    cbw.before_write(256 << 10, 256 << 10);
    served.image.discard(256 << 10, 256 << 10).unwrap();

    disk.read_at(&mut buf[..4096], w).unwrap();
    assert!(buf[..4096] == pattern(2, w, 4096), "the guest's write");
    disk.read_at(&mut buf[..4096], 256 << 10).unwrap();
    assert!(buf[..4096] == [0; 4096], "the discard reads as zeroes");
    cbw.read(0, &mut buf).unwrap();
    assert!(buf == at_start, "the view is the instant");
    assert_eq!(cbw.stats().copied_clusters, 2);
}

/// The copy bits of a 2 EiB disk at 2 MiB clusters (2^40 clusters) cost
/// nothing until set, and a bit set at either end or in the middle makes
/// only its own path: set once, read back, its neighbours clear.
#[test]
fn cluster_bits_follow_what_is_set_not_the_disk() {
    let clusters = 1u64 << 40;
    let bits = ClusterBits::new(clusters);
    assert_eq!(bits.height, 3);
    let Node::Inner(root) = &bits.root else {
        panic!("a root leaf for 2^40 clusters");
    };
    assert_eq!(root.len(), 128);
    for c in [0, (1 << 39) + 12345, clusters - 1] {
        assert!(!bits.get(c));
        assert!(bits.set(c), "{c} was clear");
        assert!(!bits.set(c), "{c} is set");
        assert!(bits.get(c));
        for n in [c.wrapping_sub(1), c + 1] {
            if n < clusters && ![0, (1 << 39) + 12345, clusters - 1].contains(&n) {
                assert!(!bits.get(n), "{n}, next to {c}");
            }
        }
    }
    assert_eq!(root.iter().filter(|s| s.get().is_some()).count(), 3);
    // A small disk is one leaf, as long as its clusters.
    let small = ClusterBits::new(100);
    assert_eq!(small.height, 0);
    assert!(matches!(&small.root, Node::Leaf(w) if w.len() == 2));
    assert!(small.set(99) && small.get(99) && !small.get(98));
}

/// One `allocation` call of a qcow2 disk maps a bounded number of
/// clusters, whatever it is asked: on 8 MiB of data in 512-byte clusters
/// (16384 clusters) it answers for at most `MAX_EXAMINED` of them, and
/// the caller asks again from there.
#[test]
fn a_qcow2_allocation_call_does_bounded_work() {
    use crate::disk::{Live, OpenOptions as DiskOptions};
    let dir = tempfile::tempdir().unwrap();
    let raw = dir.path().join("data.raw");
    std::fs::write(&raw, pattern(3, 0, (8 * MIB) as usize)).unwrap();
    let top = dir.path().join("small.qcow2");
    ringblk_testkit::qemu_img::qemu_img(&[
        "convert",
        "-q",
        "-f",
        "raw",
        "-O",
        "qcow2",
        "-o",
        "cluster_size=512",
        raw.to_str().unwrap(),
        top.to_str().unwrap(),
    ]);
    let live = Arc::new(
        Live::open(
            &top,
            crate::disk::Format::Qcow2,
            DiskOptions::default(),
            false,
            None,
        )
        .unwrap(),
    );
    let disk = Reader::new(live, 8 * MIB);
    let cap = crate::disk::reader::MAX_EXAMINED * 512;
    assert!(cap < 8 * MIB);
    assert_eq!(disk.allocation(0, 8 * MIB).unwrap(), (cap, 0));
    assert_eq!(disk.allocation(cap, 8 * MIB).unwrap(), (cap, 0));
    // A short question is answered in full.
    assert_eq!(disk.allocation(512 * 3, 5000).unwrap(), (5000, 0));
}
