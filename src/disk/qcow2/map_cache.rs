//! The mapping cache the queue threads read without I/O: guest granule
//! (the smallest cluster of the chain) to where it lives.
//!
//! Bounded: `SHARDS` shards of at most `capacity / SHARDS` entries; a full
//! shard is emptied (the entries come back from imago's L2 cache on the
//! next miss). Only the metadata path inserts or removes, under the image's
//! metadata lock, so an entry is never older than the mapping it caches;
//! the queue threads only read.

use std::collections::HashMap;
use std::sync::RwLock;

const SHARDS: usize = 64;

/// A cached location, packed into a `u64` (0: not cached).
/// bits 0-1: kind; bits 2-7: file index; bits 9-63: granule's host offset.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Loc {
    /// Data at `offset` of file `file`; `writable` only for the top's own
    /// (copied) clusters, which a write may go to directly.
    Data {
        file: usize,
        offset: u64,
        writable: bool,
    },
    /// Reads as zeroes (a zero cluster, or unallocated down the chain).
    Zero,
}

const KIND_WRITABLE: u64 = 1;
const KIND_DATA: u64 = 2;
const KIND_ZERO: u64 = 3;
/// Chains are at most this many files deep (the file index has 6 bits).
pub const MAX_FILES: usize = 64;

impl Loc {
    fn pack(self) -> u64 {
        match self {
            Loc::Data {
                file,
                offset,
                writable,
            } => {
                debug_assert!(file < MAX_FILES && offset & 511 == 0);
                let kind = if writable { KIND_WRITABLE } else { KIND_DATA };
                offset | (file as u64) << 2 | kind
            }
            Loc::Zero => KIND_ZERO,
        }
    }

    fn unpack(v: u64) -> Option<Loc> {
        match v & 3 {
            KIND_WRITABLE | KIND_DATA => Some(Loc::Data {
                file: ((v >> 2) & 63) as usize,
                offset: v & !511,
                writable: v & 3 == KIND_WRITABLE,
            }),
            KIND_ZERO => Some(Loc::Zero),
            _ => None,
        }
    }
}

pub struct MapCache {
    shards: Vec<RwLock<HashMap<u64, u64>>>,
    per_shard: usize,
}

impl MapCache {
    /// Most entries it holds.
    pub fn capacity(&self) -> usize {
        self.per_shard * SHARDS
    }

    pub fn new(capacity: usize) -> MapCache {
        MapCache {
            shards: (0..SHARDS).map(|_| RwLock::new(HashMap::new())).collect(),
            per_shard: capacity.div_ceil(SHARDS).max(1),
        }
    }

    fn shard(&self, granule: u64) -> &RwLock<HashMap<u64, u64>> {
        &self.shards[(granule as usize) % SHARDS]
    }

    pub fn get(&self, granule: u64) -> Option<Loc> {
        let shard = self
            .shard(granule)
            .read()
            .unwrap_or_else(|e| e.into_inner());
        shard.get(&granule).and_then(|&v| Loc::unpack(v))
    }

    pub fn insert(&self, granule: u64, loc: Loc) {
        let mut shard = self
            .shard(granule)
            .write()
            .unwrap_or_else(|e| e.into_inner());
        if shard.len() >= self.per_shard && !shard.contains_key(&granule) {
            shard.clear();
        }
        shard.insert(granule, loc.pack());
    }

    pub fn remove(&self, granule: u64) {
        self.shard(granule)
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&granule);
    }

    pub fn clear(&self) {
        for s in &self.shards {
            s.write().unwrap_or_else(|e| e.into_inner()).clear();
        }
    }

    /// Entries cached now (one read lock per shard).
    pub fn entries(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.read().unwrap_or_else(|e| e.into_inner()).len())
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packs_and_bounds() {
        let c = MapCache::new(128);
        let d = Loc::Data {
            file: 5,
            offset: 0x1234_0000,
            writable: false,
        };
        c.insert(7, d);
        c.insert(8, Loc::Zero);
        assert_eq!(c.get(7), Some(d));
        assert_eq!(c.get(8), Some(Loc::Zero));
        assert_eq!(c.get(9), None);
        for g in 0..10_000 {
            c.insert(g, Loc::Zero);
        }
        assert!(c.entries() <= 128, "cache grew to {}", c.entries());
    }
}
