//! AES-XTS throughput of `crypto::xts` on one core: encrypt and decrypt in
//! place, 4096- and 512-byte sectors, one 4 KiB request or 64 KiB per
//! call, AES-256 (the LUKS default) and AES-128. Compare, in the same run,
//! with OpenSSL's `openssl speed -evp aes-256-xts -bytes 4096 -seconds 3`
//! (docs/benchmarks.md, "AES-XTS throughput").
//!
//! `cargo bench --bench xts`

use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use ringblk::crypto::xts::{IvUnit, SectorLayout, Xts};

fn bench(c: &mut Criterion) {
    let key: Vec<u8> = (0..64u8).map(|i| i.wrapping_mul(37) ^ 0x5c).collect();
    let cases = [
        (64, 4096, 4096),
        (64, 4096, 65536),
        (64, 512, 4096),
        (64, 512, 65536),
        (32, 4096, 65536),
    ];
    let mut g = c.benchmark_group("xts");
    for (key_len, sector, len) in cases {
        let xts = Xts::new(&key[..key_len]).unwrap();
        let layout = SectorLayout::new(sector, IvUnit::Bytes512, 0).unwrap();
        let mut buf = vec![0xa5u8; len];
        let name = format!("aes{}/sector{sector}/{}k", key_len * 4, len / 1024);
        g.throughput(Throughput::Bytes(len as u64));
        g.bench_function(format!("{name}/encrypt"), |b| {
            b.iter(|| xts.encrypt(&layout, 1 << 20, &mut buf).unwrap())
        });
        g.bench_function(format!("{name}/decrypt"), |b| {
            b.iter(|| xts.decrypt(&layout, 1 << 20, &mut buf).unwrap())
        });
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    targets = bench
}
criterion_main!(benches);
