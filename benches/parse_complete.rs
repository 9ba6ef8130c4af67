//! The per-request CPU cost of the ring path, without I/O: pop a batch of
//! chains (one avail->idx read), parse and validate each into a `Request`,
//! write its used element, publish once and decide once about a
//! notification. Runs on virtio-queue's mock split queue in plain memory.
//!
//! `cargo bench --bench parse_complete`

use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use ringblk::virtio::chain_writer::{DescTable, readable, writable};
use ringblk::virtio::ring::{RingShadow, RingView};
use ringblk::virtio::{DeviceLimits, GuestMem, Request};
use virtio_queue::mock::MockSplitQueue;
use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress};

const QSIZE: u16 = 256;
/// Where the used ring goes: clear of the mock's avail ring (its own
/// placement overlaps it for queues above 2 entries).
const USED: u64 = 0x1_0000;
const HDR: u64 = 0x10_0000;
const DATA: u64 = 0x20_0000;
const STATUS: u64 = 0x30_0000;

/// Posts `n` 4 KiB reads (header, data, status: what Linux and libblkio
/// send) and returns the queue, ready to pop.
fn setup(mem: &GuestMem, n: u16) -> Queue {
    let mock = MockSplitQueue::new(mem, QSIZE);
    let table = DescTable(mock.desc_table_addr());
    for i in 0..n {
        let hdr = HDR + 16 * u64::from(i);
        let mut h = [0u8; 16];
        h[8..16].copy_from_slice(&(u64::from(i) * 8).to_le_bytes());
        mem.write_slice(&h, GuestAddress(hdr)).unwrap();
        let chain = [
            readable(hdr, 16),
            writable(DATA + 4096 * u64::from(i), 4096),
            writable(STATUS + u64::from(i), 1),
        ];
        let head = table.write_chain(mem, 3 * i, &chain).unwrap();
        mock.avail()
            .ring()
            .ref_at(usize::from(i))
            .unwrap()
            .store(head);
    }
    mock.avail().idx().store(n);
    let mut q: Queue = mock.create_queue().unwrap();
    q.set_used_ring_address(Some(USED as u32), Some(0));
    q.set_event_idx(true);
    q
}

fn bench(c: &mut Criterion) {
    let mem = GuestMem::from_ranges(&[(GuestAddress(0), 0x40_0000)]).unwrap();
    // The snapshot requests hold: the same regions.
    let snapshot = std::sync::Arc::new(mem.clone());
    let (limits, capacity) = (DeviceLimits::default(), 1 << 21);
    let mut g = c.benchmark_group("parse_complete");
    for batch in [1u16, 16, 64] {
        g.throughput(Throughput::Elements(u64::from(batch)));
        g.bench_function(format!("batch{batch}"), |b| {
            b.iter_batched(
                || (setup(&mem, batch), RingShadow::default()),
                |(mut q, mut shadow)| {
                    let mut reqs = Vec::with_capacity(usize::from(batch));
                    let view = RingView::new(&q, &mem);
                    shadow
                        .pop(&mut q, &view, usize::from(batch), |chain| {
                            reqs.push(
                                Request::parse(chain, &snapshot, &limits, capacity, QSIZE).unwrap(),
                            )
                        })
                        .unwrap();
                    for r in &reqs {
                        assert!(ringblk::virtio::Status::Ok.write(&mem, r.status_addr()));
                        shadow
                            .add_used(&mut q, &view, r.head(), r.written_len() + 1)
                            .unwrap();
                    }
                    shadow.publish(&q, &view).unwrap();
                    shadow.needs_notification(&q, &view).unwrap()
                },
                BatchSize::SmallInput,
            )
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
