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
