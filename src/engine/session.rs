//! One sequence's state: its KV cache (on the device, in host memory, or blocks of the engine's
//! pool), how far it has been filled, its query probe and its recorded decode step; a fresh one
//! from [`Engine::new_session`], and the pool's blocks a paged session takes as it grows (all or
//! none). Reading and writing its cache rows is `kv_rows`'s, measuring with its probe `probe`'s,
//! replaying its recorded step `recorded`'s.

use super::kv_pool::{SharedPool, lock_pool};
use super::{Engine, EngineError, Result};
use crate::backend::{Backend, HostStage, KV_BLOCK};

/// One sequence's state on the device: its KV cache and how far it has been filled.
pub struct Session<B: Backend> {
    pub(super) kv: SessionKv<B>,
    pub(super) pos: usize,
    pub(super) ctx: usize,
    pub(super) probe: Option<QueryProbe<B>>,
    /// Its one-token decode step, recorded ([`Engine::with_recorded_steps`]).
    pub(super) recorded: Recorded<B>,
}

/// Where a session's recorded decode step stands. A recording names every buffer of the step, so
/// it is replayed only while no device allocation has been taken since it was made (the
/// backend's allocation count, noted beside it); a step is recorded only after one ran plainly
/// with no allocation after it, so its buffers and kernels are settled first.
pub(super) enum Recorded<B: Backend> {
    None,
    /// A plain step ran, and the allocation count after it.
    Ran(u64),
    Held(B::Recording, u64),
    /// Recording failed (an op no recording holds): this session's steps run plainly.
    Refused,
}

/// Where a session's keys and values live.
pub(super) enum SessionKv<B: Backend> {
    /// Every layer's cache on the device.
    Device { k: Vec<B::Kv>, v: Vec<B::Kv> },
    /// In host memory (see [`PrefillLayout::kv_host`](crate::footprint::PrefillLayout::kv_host)).
    Host(HostKv<B>),
    /// Blocks of the engine's KV pool.
    Paged(PagedKv<B>),
}

pub(super) struct PagedKv<B: Backend> {
    pub(super) pool: SharedPool<B>,
    /// The pool's blocks holding positions `0..16`, `16..32`, … in order.
    pub(super) blocks: Vec<u32>,
    /// `blocks` on the device (rewritten before a step when `dirty`).
    pub(super) table: B::KvTable,
    pub(super) dirty: bool,
}

impl<B: Backend> PagedKv<B> {
    /// Give back the blocks past the first `keep`.
    fn shrink(&mut self, keep: usize) {
        if keep < self.blocks.len() {
            lock_pool(&self.pool).give_back(&self.blocks[keep..]);
            self.blocks.truncate(keep);
            self.dirty = true;
        }
    }
}

impl<B: Backend> Drop for PagedKv<B> {
    fn drop(&mut self) {
        self.shrink(0);
    }
}

pub(super) struct HostKv<B: Backend> {
    /// Per layer, the context's rows of K and V as stored (the cache's type, as on the
    /// device), page-locked where the backend pins so the copies run at the link's rate.
    pub(super) k: Vec<HostStage>,
    pub(super) v: Vec<HostStage>,
    pub(super) row_bytes: usize,
    /// One layer's K and V on the device, the session's length: refilled for each layer.
    pub(super) work_k: B::Kv,
    pub(super) work_v: B::Kv,
}

/// The most recent queries of a few layers, kept so the attention a context's positions receive
/// can be measured later (the information density of KV chunks, LLMS eq. 1).
pub(super) struct QueryProbe<B: Backend> {
    pub(super) layers: Vec<usize>,
    /// Per probed layer: a ring of [`PROBE_QUERIES`](crate::footprint::PROBE_QUERIES) query rows (after RoPE).
    pub(super) q: Vec<B::Tensor>,
    /// Per probed layer: the newest query of a recorded step, which writes it here (one fixed
    /// row; the ring row changes every step) and is copied into the ring after the step.
    pub(super) staged: Vec<B::Tensor>,
    /// Position of the query in each ring row (`usize::MAX`: empty).
    pub(super) positions: Vec<usize>,
    pub(super) next: usize,
}

impl<B: Backend> Session<B> {
    /// Tokens evaluated so far.
    pub fn position(&self) -> usize {
        self.pos
    }

    /// Positions this session can hold.
    pub fn context_size(&self) -> usize {
        self.ctx
    }

    /// Forget the queries the probe remembers (a session taken over by another context: its
    /// density must come from that context's own queries).
    pub fn forget_queries(&mut self) {
        if let Some(p) = &mut self.probe {
            p.positions.fill(usize::MAX);
            p.next = 0;
        }
    }

    /// Forget everything after the first `pos` tokens (their cache rows are overwritten later;
    /// a paged session gives back the blocks it no longer needs).
    pub fn truncate(&mut self, pos: usize) {
        self.pos = self.pos.min(pos);
        if let SessionKv::Paged(p) = &mut self.kv {
            p.shrink(self.pos.div_ceil(KV_BLOCK));
        }
    }

    /// Forget every token and give back a paged session's blocks (a context swapped out of
    /// its session: its chunks are written elsewhere).
    pub fn release(&mut self) {
        self.pos = 0;
        if let SessionKv::Paged(p) = &mut self.kv {
            p.shrink(0);
        }
    }

    /// Blocks of the KV pool this session holds (0 unless paged).
    pub fn kv_blocks(&self) -> usize {
        match &self.kv {
            SessionKv::Paged(p) => p.blocks.len(),
            _ => 0,
        }
    }

    /// Declare the first `pos` cache rows valid: rows written with [`Engine::write_kv`], or a
    /// jump back to recompute the rows from `pos` on (the rows after stay as written).
    pub fn set_position(&mut self, pos: usize) -> Result<()> {
        if pos > self.ctx {
            return Err(EngineError::ContextFull {
                needed: pos,
                ctx: self.ctx,
            });
        }
        self.pos = pos;
        Ok(())
    }
}

impl<B: Backend> Engine<B> {
    /// A fresh session holding up to `ctx` positions.
    pub fn new_session(&self, ctx: usize) -> Result<Session<B>> {
        if ctx > self.spec.max_context {
            return Err(EngineError::ContextTooLarge {
                requested: ctx,
                max: self.spec.max_context,
            });
        }
        let (kv, ty) = (self.spec.kv_dim(), self.kv_type);
        let kv = if let Some(pool) = &self.pool {
            SessionKv::Paged(PagedKv {
                pool: pool.clone(),
                blocks: Vec::new(),
                table: self.backend.alloc_kv_table(ctx.div_ceil(KV_BLOCK))?,
                dirty: false,
            })
        } else if self.prefill.kv_host {
            let row_bytes = ty.row_bytes(kv);
            let values = (ctx * row_bytes).div_ceil(4);
            let stages = || -> Result<Vec<HostStage>> {
                (0..self.spec.n_layers)
                    .map(|_| Ok(HostStage::new(&self.backend, values)?))
                    .collect()
            };
            SessionKv::Host(HostKv {
                k: stages()?,
                v: stages()?,
                row_bytes,
                work_k: self.backend.alloc_kv(ctx, kv, ty)?,
                work_v: self.backend.alloc_kv(ctx, kv, ty)?,
            })
        } else {
            let mut k = Vec::with_capacity(self.spec.n_layers);
            let mut v = Vec::with_capacity(self.spec.n_layers);
            for _ in 0..self.spec.n_layers {
                k.push(self.backend.alloc_kv(ctx, kv, ty)?);
                v.push(self.backend.alloc_kv(ctx, kv, ty)?);
            }
            SessionKv::Device { k, v }
        };
        Ok(Session {
            kv,
            pos: 0,
            ctx,
            probe: None,
            recorded: Recorded::None,
        })
    }

    /// Blocks a paged session still has to take to hold its first `rows` positions.
    fn blocks_missing(s: &Session<B>, rows: usize) -> usize {
        match &s.kv {
            SessionKv::Paged(p) => rows.div_ceil(KV_BLOCK).saturating_sub(p.blocks.len()),
            _ => 0,
        }
    }

    /// Give each paged session of `want` (session, positions it must hold) the blocks it lacks,
    /// all or none: when the pool cannot give every one of them, nothing is taken.
    pub(super) fn take_blocks(&self, want: &mut [(&mut Session<B>, usize)]) -> Result<()> {
        let needed: usize = want.iter().map(|(s, r)| Self::blocks_missing(s, *r)).sum();
        if needed == 0 {
            return Ok(());
        }
        let Some(pool) = &self.pool else {
            return Ok(());
        };
        let mut pool = lock_pool(pool);
        if needed > pool.free.len() {
            return Err(EngineError::KvPoolFull {
                needed,
                free: pool.free.len(),
                total: pool.total,
            });
        }
        for (s, rows) in want.iter_mut() {
            let missing = Self::blocks_missing(s, *rows);
            if let SessionKv::Paged(p) = &mut s.kv
                && missing > 0
            {
                p.blocks.extend(pool.take_lowest(missing));
                p.dirty = true;
            }
        }
        Ok(())
    }

    /// A paged session's block table on the device, up to date.
    pub(super) fn sync_table(&self, p: &mut PagedKv<B>) -> Result<()> {
        if p.dirty {
            self.backend.write_kv_table(&mut p.table, &p.blocks)?;
            p.dirty = false;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use crate::backend::KV_BLOCK;
    use crate::engine::testing::Tiny;
    use crate::engine::{EngineError, Logits, PoolUsage};

    fn usage(free: usize, total: usize) -> Option<PoolUsage> {
        Some(PoolUsage { free, total })
    }

    #[test]
    fn truncating_and_releasing_a_paged_session_give_its_blocks_back() {
        let tiny = Tiny::new();
        let e = tiny.engine().with_kv_pool(8).unwrap();
        let mut s = e.new_session(128).unwrap();
        let tokens: Vec<u32> = (0..40).collect();
        e.forward(&mut s, &tokens, Logits::None).unwrap();
        assert_eq!((s.kv_blocks(), e.pool_usage()), (3, usage(5, 8)));
        s.truncate(KV_BLOCK + 1);
        assert_eq!((s.position(), s.kv_blocks()), (KV_BLOCK + 1, 2));
        assert_eq!(e.pool_usage(), usage(6, 8));
        // Truncating past the position keeps it.
        s.truncate(40);
        assert_eq!((s.position(), s.kv_blocks()), (KV_BLOCK + 1, 2));
        s.release();
        assert_eq!((s.position(), s.kv_blocks()), (0, 0));
        assert_eq!(e.pool_usage(), usage(8, 8));
        // Growing again takes the lowest blocks; dropping the session gives them back.
        e.forward(&mut s, &tokens[..20], Logits::Last).unwrap();
        assert_eq!((s.kv_blocks(), e.pool_usage()), (2, usage(6, 8)));
        drop(s);
        assert_eq!(e.pool_usage(), usage(8, 8));
    }

    #[test]
    fn a_step_the_pool_cannot_hold_takes_no_block_for_any_session() {
        let tiny = Tiny::new();
        let e = tiny.engine().with_kv_pool(3).unwrap();
        let mut a = e.new_session(64).unwrap();
        let tokens: Vec<u32> = (0..2 * KV_BLOCK as u32).collect();
        e.forward(&mut a, &tokens, Logits::None).unwrap();
        assert_eq!(e.pool_usage(), usage(1, 3));
        // Two sessions each needing a block, one free: neither takes it.
        let (mut b, mut c) = (e.new_session(64).unwrap(), e.new_session(64).unwrap());
        let err = e.decode_many(&mut [(&mut b, 1), (&mut c, 2)]).unwrap_err();
        assert!(
            matches!(
                err,
                EngineError::KvPoolFull {
                    needed: 2,
                    free: 1,
                    total: 3
                }
            ),
            "{err:?}"
        );
        assert_eq!((b.kv_blocks(), c.kv_blocks(), b.position()), (0, 0, 0));
        assert_eq!(e.pool_usage(), usage(1, 3));
        // One of them alone fits.
        e.decode_many(&mut [(&mut b, 1)]).unwrap();
        assert_eq!((b.kv_blocks(), e.pool_usage()), (1, usage(0, 3)));
    }
}
