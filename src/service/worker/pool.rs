//! Slots and the KV pool: which free slot a request takes (its context's, the longest shared
//! prefix, else by eviction rank), how long a prompt may join a step, the blocks the running
//! sequences were promised, and idle slots' sessions given up when the pool runs short.

use super::Worker;
use super::slot::{Holder, common_prefix, eviction_rank};
use crate::backend::Backend;

impl<B: Backend> Worker<B> {
    /// Pick a free slot: the one already holding `context`, else the stateless one sharing
    /// the longest prefix with `tokens`, else empty, else least recently used.
    pub(super) fn pick_slot(
        &self,
        context: Option<&str>,
        tokens: &[u32],
    ) -> Option<(usize, usize)> {
        let free = || self.slots.iter().enumerate().filter(|(_, s)| !s.busy);
        if let Some(id) = context
            && let Some((i, _)) = free().find(|(_, s)| s.holder == Holder::Context(id.into()))
        {
            return Some((i, 0));
        }
        if context.is_none() {
            let best = free()
                .filter_map(|(i, s)| match &s.holder {
                    Holder::Anon(t) => Some((i, common_prefix(t, tokens))),
                    _ => None,
                })
                .max_by_key(|&(i, n)| (n, std::cmp::Reverse(i)));
            if let Some((i, n)) = best
                && n > 0
            {
                return Some((i, n));
            }
        }
        // Contexts are worth more than a stateless prefix: evict those last.
        free()
            .min_by_key(|(_, s)| eviction_rank(&s.holder, s.last_use))
            .map(|(i, _)| (i, 0))
    }

    /// The longest prompt (rest) that joins a step instead of running alone: what the step
    /// holds beside one token of every sequence; longer prompts run alone right away, layer by
    /// layer where the step cannot hold them (one pass of the weights for the whole prompt).
    pub(super) fn joining_rows(&self) -> usize {
        let layout = self.engine.prefill();
        if layout.joins {
            layout.group.saturating_sub(self.cfg.parallel)
        } else {
            0
        }
    }

    /// Blocks of the KV pool the running sequences may come to hold.
    pub(super) fn pool_committed(&self) -> usize {
        self.active.iter().map(|s| s.pool_blocks).sum()
    }

    /// Free at least `needed` blocks of the KV pool by taking idle slots' sessions away, in
    /// eviction order (never slot `keep`); a context's chunks are written first where they are
    /// not yet (ahead-of-time swap-out held back while calls ran), so it only needs swapping
    /// back in at its next call. Whether enough are free.
    pub(super) fn make_room(&mut self, needed: usize, keep: Option<usize>) -> bool {
        let free = |w: &Self| w.engine.pool_usage().map_or(0, |u| u.free);
        let mut idle: Vec<usize> = (0..self.slots.len())
            .filter(|&i| {
                let s = &self.slots[i];
                !s.busy && Some(i) != keep && s.session.kv_blocks() > 0
            })
            .collect();
        idle.sort_by_key(|&i| eviction_rank(&self.slots[i].holder, self.slots[i].last_use));
        for i in idle {
            if free(self) >= needed {
                break;
            }
            self.write_ahead(i);
            let s = &mut self.slots[i];
            if let Holder::Context(id) = &s.holder {
                tracing::debug!("KV pool pressure: context {id} leaves the device");
                self.shared.metrics.pool_evictions.inc();
            }
            s.session.release();
            s.holder = Holder::Free;
        }
        free(self) >= needed
    }
}
