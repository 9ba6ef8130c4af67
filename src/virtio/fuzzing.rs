//! The logic of the `parse` fuzz target (`fuzz/fuzz_targets/parse.rs`),
//! kept in the crate so that `tests/layers/fuzz_corpus.rs` replays the corpus with
//! a plain `cargo test`, on stable, without libFuzzer.
//!
//! The input is not a ring image: it steers a generator that writes mostly
//! well-formed requests into guest memory (a type, a sector, data segments
//! of whole blocks, header and status where drivers put them, sometimes an
//! indirect table), so most inputs get past the chain checks and reach the
//! per-type validation. About one chain in 32 gets one corruption: a
//! flipped WRITE flag, an address outside memory, a `next` anywhere, a wild
//! length, a missing or empty status descriptor, a nested or mis-sized
//! indirect table.
//!
//! Besides "does not panic", every outcome is checked against what
//! `Request::parse` promises: iovecs inside guest memory and adding up to
//! `data_len`, limits respected, status byte writable, and no chain-level
//! error for a chain the generator did not corrupt.

mod generator;

use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_ID_BYTES, VIRTIO_BLK_T_DISCARD, VIRTIO_BLK_T_FLUSH, VIRTIO_BLK_T_GET_ID,
    VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT, VIRTIO_BLK_T_WRITE_ZEROES,
};
use virtio_queue::{Queue, QueueOwnedT, QueueT};
use vm_memory::{GuestAddress, GuestMemoryBackend, GuestMemoryRegion};

use self::generator::{Generator, Input, Posted, pick_limits, write};
use super::request::Rejected;
use super::ring::{RingShadow, RingView};
use super::{DeviceLimits, GuestMem, Request, RequestError, RequestKind, SECTOR_SHIFT};

/// What one chain came to.
pub type Outcome = Result<RequestKind, RequestError>;

// Guest memory: region A, a hole, then regions B and C back to back.
const A_END: u64 = 0x10_0000;
const B: u64 = 0x18_0000;
const C: u64 = 0x1c_0000;
const C_END: u64 = 0x20_0000;
// The rings (up to 256 entries), indirect tables, then small per-chain
// buffers; data buffers above, wrapping round when they run out.
const DESC: u64 = 0;
const AVAIL: u64 = 0x1000;
const USED: u64 = 0x2000;
const TABLES: u64 = 0x3000;
const TABLE_SPACING: u64 = 0x1000;
const SMALL: u64 = 0x8000;
const DATA: u64 = 0x1_0000;

const MAX_CHAINS: usize = 4;
const MAX_SEGS: u64 = 64;

/// Runs one fuzz input: builds up to four chains from `data`, parses each
/// and checks the result. Panics on a broken promise.
pub fn parse_one(data: &[u8]) -> Vec<Outcome> {
    let mut input = Input(data);
    let (limits, capacity) = pick_limits(&mut input);
    let queue_size = 16u16 << input.below(5);
    let mem = std::sync::Arc::new(
        GuestMem::from_ranges(&[
            (GuestAddress(0), A_END as usize),
            (GuestAddress(B), (C - B) as usize),
            (GuestAddress(C), (C_END - C) as usize),
        ])
        .expect("fixed, valid layout"),
    );
    let mut generator = Generator::new(&mem, (limits, capacity), queue_size);
    let n_chains = 1 + input.below(MAX_CHAINS as u32) as usize;
    let mut posted = Vec::new();
    for k in 0..n_chains {
        let Some(chain) = generator.chain(&mut input, k) else {
            break;
        };
        let avail_entry = GuestAddress(AVAIL + 4 + 2 * k as u64);
        write(&mem, chain.head.to_le(), avail_entry);
        posted.push(chain);
    }
    write(&mem, (posted.len() as u16).to_le(), GuestAddress(AVAIL + 2));

    let mut queue = Queue::new(queue_size).expect("power of two up to 256");
    queue.set_desc_table_address(Some(DESC as u32), Some(0));
    queue.set_avail_ring_address(Some(AVAIL as u32), Some(0));
    queue.set_used_ring_address(Some(USED as u32), Some(0));
    queue.set_ready(true);
    let chains: Vec<_> = match queue.iter(&*mem) {
        Ok(iter) => iter.collect(),
        Err(e) => panic!("queue refused a sane avail ring: {e}"),
    };
    assert_eq!(chains.len(), posted.len());
    // Descriptor for descriptor, virtio-queue's walk and the worker's over
    // the rings translated for its pass.
    let view = RingView::new(&queue, &*mem);
    for chain in &chains {
        let limit = usize::from(queue_size) + 300;
        let ours: Vec<_> = view
            .chain(chain.head_index())
            .take(limit)
            .map(raw)
            .collect();
        let theirs: Vec<_> = chain.clone().take(limit).map(raw).collect();
        assert_eq!(
            ours,
            theirs,
            "the two walks of chain {} differ",
            chain.head_index()
        );
    }
    let parsed: Vec<_> = chains
        .into_iter()
        .map(|chain| Request::parse(chain, &mem, &limits, capacity, queue_size))
        .collect();

    // The worker pops and parses the same chains over the view: the same
    // results.
    queue.set_next_avail(0);
    let mut walked = Vec::new();
    RingShadow::default()
        .pop(&mut queue, &view, MAX_CHAINS, |chain| {
            walked.push(Request::parse(chain, &mem, &limits, capacity, queue_size));
        })
        .expect("the same avail ring");
    assert_eq!(walked.len(), parsed.len());
    for (a, b) in parsed.iter().zip(&walked) {
        assert_eq!(summary(a), summary(b), "the two walks disagree");
    }

    parsed
        .into_iter()
        .zip(&posted)
        .map(|(res, want)| check(&mem, &limits, capacity, want, res))
        .collect()
}

/// A descriptor's fields.
fn raw(d: virtio_queue::desc::split::Descriptor) -> (u64, u32, u16, u16) {
    (d.addr().0, d.len(), d.flags(), d.next())
}

/// What a parse came to, comparable.
type Summary = Result<(u16, RequestKind, Vec<(usize, usize)>, GuestAddress), Rejected>;

fn summary(res: &Result<Request, Rejected>) -> Summary {
    match res {
        Ok(r) => Ok((
            r.head(),
            r.kind(),
            r.data()
                .iovecs()
                .iter()
                .map(|v| (v.iov_base as usize, v.iov_len))
                .collect(),
            r.status_addr(),
        )),
        Err(rej) => Err(rej.clone()),
    }
}

/// Checks one parse result against the promises of `Request::parse`.
fn check(
    mem: &GuestMem,
    limits: &DeviceLimits,
    capacity_sectors: u64,
    want: &Posted,
    res: Result<Request, Rejected>,
) -> Outcome {
    let req = match res {
        Ok(req) => req,
        Err(rej) => {
            assert_eq!(rej.head, want.head);
            if let Some(status) = rej.status {
                assert!(mem.address_in_range(status), "status byte outside memory");
            }
            if !want.corrupted {
                assert!(
                    !matches!(
                        rej.error,
                        RequestError::IllFormedChain
                            | RequestError::BadAddress
                            | RequestError::ShortHeader
                            | RequestError::WrongDirection
                    ),
                    "well-formed {:?} chain refused: {:?}",
                    want.req_type,
                    rej.error
                );
                assert!(
                    rej.status.is_some(),
                    "well-formed chain without a status byte"
                );
            }
            return Err(rej.error);
        }
    };
    assert_eq!(req.head(), want.head);
    assert!(
        mem.address_in_range(req.status_addr()),
        "status byte outside memory"
    );
    let mut total = 0u64;
    for v in req.data().iovecs() {
        assert!(v.iov_len > 0, "empty iovec");
        assert!(
            in_host_memory(mem, v.iov_base as usize, v.iov_len),
            "iovec outside guest memory"
        );
        total += v.iov_len as u64;
    }
    assert_eq!(total, u64::from(req.data_len()));
    let bs_sectors = u64::from(limits.block_size >> SECTOR_SHIFT);
    let in_capacity = |sector: u64, sectors: u64| {
        sector
            .checked_add(sectors)
            .is_some_and(|end| end <= capacity_sectors)
            && sector.is_multiple_of(bs_sectors)
    };
    let expected_type = match req.kind() {
        RequestKind::Read { sector } | RequestKind::Write { sector } => {
            assert_eq!(req.data_len() % limits.block_size, 0);
            // A buffer crosses at most one boundary (B into C).
            assert!(req.data().iovecs().len() <= 2 * limits.seg_max as usize);
            assert!(in_capacity(
                sector,
                u64::from(req.data_len()) >> SECTOR_SHIFT
            ));
            if let RequestKind::Write { .. } = req.kind() {
                assert!(!limits.readonly);
                VIRTIO_BLK_T_OUT
            } else {
                VIRTIO_BLK_T_IN
            }
        }
        RequestKind::Flush => {
            assert!(req.data().iovecs().is_empty());
            VIRTIO_BLK_T_FLUSH
        }
        RequestKind::GetId => {
            assert!(req.written_len() <= VIRTIO_BLK_ID_BYTES);
            VIRTIO_BLK_T_GET_ID
        }
        RequestKind::Discard(r) | RequestKind::WriteZeroes(r) => {
            assert!(!limits.readonly);
            assert!(req.data().iovecs().is_empty());
            assert!(in_capacity(r.sector, u64::from(r.num_sectors)));
            if let RequestKind::Discard(_) = req.kind() {
                assert!(!r.unmap && r.num_sectors <= limits.max_discard_sectors);
                VIRTIO_BLK_T_DISCARD
            } else {
                assert!(r.num_sectors <= limits.max_write_zeroes_sectors);
                VIRTIO_BLK_T_WRITE_ZEROES
            }
        }
    };
    if !want.corrupted {
        assert_eq!(expected_type, want.req_type, "parsed as another type");
    }
    Ok(req.kind())
}

/// Whether `[base, base + len)` lies in one region's host mapping.
fn in_host_memory(mem: &GuestMem, base: usize, len: usize) -> bool {
    mem.iter().any(|r| {
        let Ok(start) = mem.get_host_address(r.start_addr()) else {
            return false;
        };
        let start = start as usize;
        base >= start
            && base
                .checked_add(len)
                .is_some_and(|end| end <= start + r.len() as usize)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_input_is_one_good_read() {
        let out = parse_one(&[]);
        assert_eq!(out, vec![Ok(RequestKind::Read { sector: 0 })]);
    }

    #[test]
    fn pseudo_random_inputs_keep_every_promise() {
        // A few thousand inputs from a fixed xorshift: most must parse, and
        // every request type must come out at least once.
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut ok = 0;
        let mut kinds = [false; 6];
        for _ in 0..3000 {
            let buf: Vec<u8> = (0..64)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x as u8
                })
                .collect();
            for o in parse_one(&buf).into_iter().flatten() {
                ok += 1;
                let i = match o {
                    RequestKind::Read { .. } => 0,
                    RequestKind::Write { .. } => 1,
                    RequestKind::Flush => 2,
                    RequestKind::GetId => 3,
                    RequestKind::Discard(_) => 4,
                    RequestKind::WriteZeroes(_) => 5,
                };
                kinds[i] = true;
            }
        }
        assert!(ok > 1000, "only {ok} requests parsed");
        assert_eq!(kinds, [true; 6]);
    }
}
