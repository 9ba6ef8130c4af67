//! The write path's cost of a dirty bitmap: `DirtyBitmap::mark` of a 4 KiB
//! write at scattered offsets of a 64 GiB disk (64 KiB granules), on the
//! heap and in a sidecar's shared file mapping, for granules still clean
//! (an atomic OR) and already dirty (a load only). Compare with the
//! per-request cost of the ring path (`parse_complete`).
//!
//! `cargo bench --bench bitmap_mark`

use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use ringblk::bitmap::{BitmapStore, DEFAULT_GRANULARITY, DirtyBitmap, SidecarStore};

const DISK: u64 = 64 << 30;
const MARKS: u64 = 4096;

/// Offsets spread over the disk, 4 KiB aligned.
fn offsets() -> Vec<u64> {
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    (0..MARKS)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % (DISK / 4096) * 4096
        })
        .collect()
}

fn bench(c: &mut Criterion) {
    let offs = offsets();
    let dir = tempfile::tempdir().unwrap();
    let mut store = SidecarStore::new(dir.path(), "disk.img").unwrap();
    let mapped = store.add("bench", DEFAULT_GRANULARITY, DISK).unwrap();
    let heap = DirtyBitmap::new(DISK, DEFAULT_GRANULARITY).unwrap();
    let mut g = c.benchmark_group("bitmap_mark");
    g.throughput(Throughput::Elements(MARKS));
    for (name, b) in [("heap", &heap), ("sidecar", &mapped)] {
        g.bench_function(format!("{name}/clean"), |bench| {
            bench.iter(|| {
                b.clear();
                for &o in &offs {
                    b.mark(o, 4096);
                }
            })
        });
        g.bench_function(format!("{name}/dirty"), |bench| {
            for &o in &offs {
                b.mark(o, 4096);
            }
            bench.iter(|| {
                for &o in &offs {
                    b.mark(o, 4096);
                }
            })
        });
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_millis(500));
    targets = bench
}
criterion_main!(benches);
