//! The paged KV pool's blocks and its free list, shared by the sessions that take blocks of it.
//! Knows neither sessions nor the engine: the engine holds the pool, sessions hold its blocks.

use std::sync::{Arc, Mutex};

use crate::backend::Backend;

/// The paged KV pool (vLLM's PagedAttention over the contexts' chunks): every layer's keys and
/// values of `total` blocks of [`KV_BLOCK`](crate::backend::KV_BLOCK) positions, one cache per
/// layer, shared by the sessions. A session takes blocks as it grows and gives them back when
/// truncated, released or dropped; its block table maps its positions to the pool's rows.
pub(super) struct KvPool<B: Backend> {
    pub(super) k: Vec<B::Kv>,
    pub(super) v: Vec<B::Kv>,
    /// Free block ids, the lowest last (taken first).
    pub(super) free: Vec<u32>,
    pub(super) total: usize,
}

pub(super) type SharedPool<B> = Arc<Mutex<KvPool<B>>>;

pub(super) fn lock_pool<B: Backend>(p: &SharedPool<B>) -> std::sync::MutexGuard<'_, KvPool<B>> {
    // A panic while the pool was held leaves ids only, never half-written state worth refusing.
    p.lock().unwrap_or_else(|e| e.into_inner())
}

impl<B: Backend> KvPool<B> {
    pub(super) fn give_back(&mut self, blocks: &[u32]) {
        self.free.extend_from_slice(blocks);
        self.free.sort_unstable_by(|a, b| b.cmp(a));
    }

    /// Take the `n` lowest free ids (at least `n` are free): the lowest first, in ascending
    /// order.
    pub(super) fn take_lowest(&mut self, n: usize) -> std::iter::Rev<std::vec::Drain<'_, u32>> {
        let at = self.free.len() - n;
        self.free.drain(at..).rev()
    }
}

/// Free and total blocks of a KV pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolUsage {
    pub free: usize,
    pub total: usize,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::CpuBackend;

    /// A pool of `blocks` free blocks, as the engine makes it (its caches play no part here).
    fn pool(blocks: u32) -> KvPool<CpuBackend> {
        KvPool {
            k: Vec::new(),
            v: Vec::new(),
            free: (0..blocks).rev().collect(),
            total: blocks as usize,
        }
    }

    #[test]
    fn a_fresh_pool_hands_out_its_lowest_blocks_first_in_ascending_order() {
        let mut p = pool(6);
        assert_eq!(p.take_lowest(2).collect::<Vec<_>>(), [0, 1]);
        assert_eq!(p.take_lowest(3).collect::<Vec<_>>(), [2, 3, 4]);
        assert_eq!(p.free, [5]);
    }

    #[test]
    fn blocks_given_back_are_handed_out_again_lowest_first() {
        let mut p = pool(8);
        let taken: Vec<u32> = p.take_lowest(6).collect();
        assert_eq!(taken, [0, 1, 2, 3, 4, 5]);
        p.give_back(&[4, 1]);
        assert_eq!(
            p.free,
            [7, 6, 4, 1],
            "the lowest last, where it is taken first"
        );
        assert_eq!(p.take_lowest(3).collect::<Vec<_>>(), [1, 4, 6]);
        p.give_back(&[0, 5, 3]);
        assert_eq!(p.take_lowest(4).collect::<Vec<_>>(), [0, 3, 5, 7]);
        assert!(p.free.is_empty());
        assert_eq!(p.total, 8);
    }
}
