//! A caching allocator over device memory: freed blocks go to a free list by
//! rounded size and are handed out again without a driver call, and the
//! bytes in use, reserved and their peaks are counted so a run's measured
//! peak can be set against the planner's prediction.
//!
//! The caching is generic over [`RawMemory`], so its accounting is tested on
//! the CPU with a fake; [`super::device`] supplies the CUDA one.

use super::error::{GpuError, GpuResult};
use std::collections::BTreeMap;

/// Where blocks come from: the driver, or a fake in tests.
pub trait RawMemory {
    type Block;
    /// A block of exactly `bytes` bytes. Failing is allowed (out of memory).
    fn alloc(&mut self, bytes: usize) -> GpuResult<Self::Block>;
    /// Give a block back to the driver.
    fn release(&mut self, block: Self::Block);
}

/// Byte counts of the allocator. `requested` counts what callers asked for,
/// `in_use` the rounded blocks they hold, `reserved` everything taken from
/// the driver (in use plus cached).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryStats {
    pub requested: usize,
    pub in_use: usize,
    pub reserved: usize,
    pub peak_requested: usize,
    pub peak_in_use: usize,
    pub peak_reserved: usize,
    /// Blocks taken from the driver / served from the cache.
    pub driver_allocs: usize,
    pub cache_hits: usize,
}

/// A block handed out by the allocator; give it back with [`CachingAllocator::free`].
#[derive(Debug)]
pub struct Allocation<B> {
    pub block: B,
    /// What the caller asked for.
    pub bytes: usize,
    /// The block's size class.
    pub rounded: usize,
}

/// Small blocks round up to 512 bytes, larger ones to 2 MiB, so that the
/// many same-shaped activations of a step land in a few size classes.
pub fn size_class(bytes: usize) -> usize {
    const SMALL: usize = 1 << 20;
    let unit = if bytes <= SMALL { 512 } else { 2 << 20 };
    bytes.max(1).div_ceil(unit) * unit
}

pub struct CachingAllocator<M: RawMemory> {
    raw: M,
    free: BTreeMap<usize, Vec<M::Block>>,
    stats: MemoryStats,
}

impl<M: RawMemory> CachingAllocator<M> {
    pub fn new(raw: M) -> Self {
        CachingAllocator {
            raw,
            free: BTreeMap::new(),
            stats: MemoryStats::default(),
        }
    }

    pub fn raw(&self) -> &M {
        &self.raw
    }

    pub fn stats(&self) -> MemoryStats {
        self.stats
    }

    /// Start measuring peaks from what is in use now.
    pub fn reset_peaks(&mut self) {
        let s = &mut self.stats;
        s.peak_requested = s.requested;
        s.peak_in_use = s.in_use;
        s.peak_reserved = s.reserved;
    }

    /// A block of at least `bytes` bytes: a cached one of the same class, else
    /// a new one; when the driver is out of memory, the cache is emptied and
    /// the driver asked once more.
    pub fn alloc(&mut self, bytes: usize) -> GpuResult<Allocation<M::Block>> {
        let rounded = size_class(bytes);
        let block = match self.free.get_mut(&rounded).and_then(Vec::pop) {
            Some(b) => {
                self.stats.cache_hits += 1;
                b
            }
            None => {
                let b = match self.raw.alloc(rounded) {
                    Ok(b) => b,
                    Err(_) => {
                        self.empty_cache();
                        self.raw.alloc(rounded).map_err(|_| GpuError::OutOfMemory {
                            bytes,
                            in_use: self.stats.in_use,
                            reserved: self.stats.reserved,
                        })?
                    }
                };
                self.stats.driver_allocs += 1;
                self.stats.reserved += rounded;
                b
            }
        };
        let s = &mut self.stats;
        s.requested += bytes;
        s.in_use += rounded;
        s.peak_requested = s.peak_requested.max(s.requested);
        s.peak_in_use = s.peak_in_use.max(s.in_use);
        s.peak_reserved = s.peak_reserved.max(s.reserved);
        Ok(Allocation {
            block,
            bytes,
            rounded,
        })
    }

    /// Return a block to the cache (not to the driver).
    pub fn free(&mut self, a: Allocation<M::Block>) {
        self.stats.requested -= a.bytes;
        self.stats.in_use -= a.rounded;
        self.free.entry(a.rounded).or_default().push(a.block);
    }

    /// Give every cached block back to the driver.
    pub fn empty_cache(&mut self) {
        for (size, blocks) in std::mem::take(&mut self.free) {
            for b in blocks {
                self.stats.reserved -= size;
                self.raw.release(b);
            }
        }
    }
}

impl<M: RawMemory> Drop for CachingAllocator<M> {
    fn drop(&mut self) {
        self.empty_cache();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake device: counts live bytes, fails past a capacity.
    struct Fake {
        live: usize,
        capacity: usize,
        next: usize,
    }

    impl RawMemory for Fake {
        type Block = (usize, usize);
        fn alloc(&mut self, bytes: usize) -> GpuResult<(usize, usize)> {
            if self.live + bytes > self.capacity {
                return Err(GpuError::Invalid("fake out of memory".into()));
            }
            self.live += bytes;
            self.next += 1;
            Ok((self.next, bytes))
        }
        fn release(&mut self, block: (usize, usize)) {
            self.live -= block.1;
        }
    }

    fn fake(capacity: usize) -> CachingAllocator<Fake> {
        CachingAllocator::new(Fake {
            live: 0,
            capacity,
            next: 0,
        })
    }

    #[test]
    fn size_classes() {
        assert_eq!(size_class(0), 512);
        assert_eq!(size_class(1), 512);
        assert_eq!(size_class(513), 1024);
        assert_eq!(size_class(1 << 20), 1 << 20);
        assert_eq!(size_class((1 << 20) + 1), 2 << 20);
        assert_eq!(size_class(5 << 20), 6 << 20);
    }

    #[test]
    fn freed_blocks_are_reused_and_peaks_tracked() {
        let mut a = fake(1 << 30);
        let x = a.alloc(1000).unwrap();
        let y = a.alloc(3000).unwrap();
        assert_eq!(a.stats().requested, 4000);
        assert_eq!(a.stats().in_use, 1024 + 3072);
        let xid = x.block.0;
        a.free(x);
        let z = a.alloc(900).unwrap();
        assert_eq!(z.block.0, xid, "same size class comes from the cache");
        let s = a.stats();
        assert_eq!((s.driver_allocs, s.cache_hits), (2, 1));
        assert_eq!(s.peak_requested, 4000);
        assert_eq!(s.requested, 3900);
        assert_eq!(s.reserved, 1024 + 3072);
        a.free(y);
        a.free(z);
        assert_eq!(a.stats().in_use, 0);
        assert_eq!(a.stats().peak_in_use, 4096);
        a.reset_peaks();
        assert_eq!(a.stats().peak_in_use, 0);
        a.empty_cache();
        assert_eq!(a.stats().reserved, 0);
        assert_eq!(a.raw().live, 0);
    }

    #[test]
    fn out_of_memory_empties_the_cache_then_fails_clearly() {
        let mut a = fake(4096);
        let x = a.alloc(3000).unwrap();
        a.free(x);
        // 3072 cached + 2048 new exceeds the capacity: the cache is emptied first.
        let y = a.alloc(2000).unwrap();
        assert_eq!(a.stats().reserved, 2048);
        let e = a.alloc(4000).unwrap_err();
        assert!(
            matches!(e, GpuError::OutOfMemory { bytes: 4000, .. }),
            "{e}"
        );
        a.free(y);
    }
}
