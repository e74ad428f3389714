//! The attention-density probe: the latest queries of a few layers kept in a session's ring, and
//! the share of attention each block of its context received from them (the information density
//! of KV chunks, LLMS eq. 1). Reads the session's keys; changes nothing a step computes.

use super::session::{QueryProbe, Session};
use super::{Engine, Result};
use crate::backend::Backend;
use crate::footprint::PROBE_QUERIES;
use crate::footprint::step::PROBE_LAYERS;

/// Bytes of K read at a time by [`Engine::attention_density`]: a context of up to this much
/// K per layer is read, scored and exponentiated once; beyond, once per pass, in runs of this
/// size, so the temporary does not grow with the context.
pub const DENSITY_READ_BYTES: usize = 4 << 20;
/// The fewest positions of a run of [`DENSITY_READ_BYTES`].
pub const DENSITY_READ_ROWS: usize = 256;

impl<B: Backend> Engine<B> {
    /// Remember the latest queries of a few layers in `session` from now on, for
    /// [`Engine::attention_density`].
    pub fn enable_probe(&self, session: &mut Session<B>) -> Result<()> {
        if session.probe.is_some() {
            return Ok(());
        }
        let n = self.spec.n_layers;
        let count = PROBE_LAYERS.min(n);
        let layers: Vec<usize> = (0..count).map(|i| (2 * i + 1) * n / (2 * count)).collect();
        let mut q = Vec::with_capacity(count);
        let mut staged = Vec::with_capacity(count);
        for _ in 0..count {
            q.push(self.backend.alloc(PROBE_QUERIES, self.spec.q_dim())?);
            staged.push(self.backend.alloc(1, self.spec.q_dim())?);
        }
        session.probe = Some(QueryProbe {
            layers,
            q,
            staged,
            positions: vec![usize::MAX; PROBE_QUERIES],
            next: 0,
        });
        Ok(())
    }

    /// Share of attention each block of `block` positions received from the remembered queries
    /// (softmax probabilities, averaged over probed layers, heads and queries; blocks sum to 1).
    /// Empty when the session has no probe or no queries yet. K is read in runs of
    /// [`DENSITY_READ_BYTES`] (at least [`DENSITY_READ_ROWS`] positions), so the temporary does
    /// not grow with the context.
    pub fn attention_density(&self, s: &mut Session<B>, block: usize) -> Result<Vec<f32>> {
        let row_bytes = self.spec.kv_dim().max(1) * std::mem::size_of::<f32>();
        let rows = (DENSITY_READ_BYTES / row_bytes).max(DENSITY_READ_ROWS);
        self.attention_density_in(s, block, rows)
    }

    /// [`Engine::attention_density`] reading K `rows` positions at a time (rounded up to whole
    /// blocks): three passes over them (each query-head's maximum score, its softmax sum, then
    /// the mass per block; K is read once when one run holds it all, else once per pass). Every
    /// sum is taken in the order of one whole-layer read (a block's mass comes from the one run
    /// that holds it), so the result is the same to the bit whatever `rows`.
    pub fn attention_density_in(
        &self,
        s: &mut Session<B>,
        block: usize,
        rows: usize,
    ) -> Result<Vec<f32>> {
        let Some(p) = &s.probe else {
            return Ok(Vec::new());
        };
        let spec = &self.spec;
        let layers = p.layers.clone();
        let pos = s.pos;
        let block = block.max(1);
        let blocks = pos.div_ceil(block);
        let mut mass = vec![0f64; blocks];
        let queries: Vec<(usize, usize)> = p
            .positions
            .iter()
            .enumerate()
            .filter(|&(_, &qp)| qp < pos)
            .map(|(r, &qp)| (r, qp))
            .collect();
        if queries.is_empty() || pos == 0 {
            return Ok(Vec::new());
        }
        let (hd, kv) = (spec.head_dim, spec.kv_dim());
        let group = spec.n_heads / spec.n_kv_heads.max(1);
        let rows = rows.clamp(1, pos).div_ceil(block) * block;
        let b = &self.backend;
        b.enter(move || {
            let Some(p) = &s.probe else {
                return Ok(Vec::new());
            };
            let mut q = vec![0f32; PROBE_QUERIES * spec.q_dim()];
            // Straight to the host, a run of rows at a time: no device temporary, and a host
            // one of `rows × kv_dim` however long the context.
            let mut k = vec![0f32; rows * kv];
            let n = queries.len() * spec.n_heads;
            // Each query head's scores over the run (`rows` to a head): computed once where one
            // run holds the whole layer (and their exponentials once), else once per pass; by
            // the host's vector kernels, 16 key rows at a time, whatever `rows`.
            let mut scores = vec![0f32; n * rows];
            let kern = crate::backend::cpu::kernels::best();
            for (li, &l) in layers.iter().enumerate() {
                b.read(&p.q[li], &mut q)?;
                let mut max = vec![f32::NEG_INFINITY; n];
                let mut sum = vec![0f64; n];
                for pass in 0..3 {
                    for first in (0..pos).step_by(rows) {
                        let len = rows.min(pos - first);
                        // One run holds the whole layer: read and scored once for the three
                        // passes.
                        if pass == 0 || rows < pos {
                            self.read_kv_rows(s, l, false, first, &mut k[..len * kv])?;
                            // Each query head's scores apart: over the threads.
                            let score = |(at, out): (usize, &mut [f32])| {
                                let (qi, h) = (at / spec.n_heads, at % spec.n_heads);
                                let (row, qp) = queries[qi];
                                let end = len.min((qp + 1).saturating_sub(first));
                                let qh = &q[row * spec.q_dim() + h * hd..][..hd];
                                let kh = (h / group.max(1)) * hd;
                                let out = &mut out[..end];
                                for (j0, o) in (0..end).step_by(16).zip(out.chunks_mut(16)) {
                                    let keys: [&[f32]; 16] = std::array::from_fn(|i| {
                                        let j = (j0 + i).min(end - 1);
                                        &k[j * kv + kh..][..hd]
                                    });
                                    (kern.scores)(&[qh], &keys[..o.len()], o);
                                }
                                for v in out.iter_mut() {
                                    *v *= spec.attn_scale;
                                }
                            };
                            use rayon::prelude::*;
                            scores.par_chunks_mut(rows).enumerate().for_each(score);
                        }
                        for (qi, &(_, qp)) in queries.iter().enumerate() {
                            if first > qp {
                                continue;
                            }
                            let end = len.min(qp + 1 - first);
                            for h in 0..spec.n_heads {
                                let at = qi * spec.n_heads + h;
                                let run = &mut scores[at * rows..][..end];
                                for (j, sc) in run.iter_mut().enumerate() {
                                    match pass {
                                        0 => max[at] = max[at].max(*sc),
                                        1 => {
                                            let e = (*sc - max[at]).exp();
                                            sum[at] += e as f64;
                                            if rows >= pos {
                                                // Kept for the last pass (the same value).
                                                *sc = e;
                                            }
                                        }
                                        _ => {
                                            let e = if rows >= pos {
                                                *sc
                                            } else {
                                                (*sc - max[at]).exp()
                                            };
                                            mass[(first + j) / block] += e as f64 / sum[at]
                                        }
                                    }
                                }
                            }
                        }
                    }
                }
            }
            let total: f64 = mass.iter().sum();
            Ok(mass
                .iter()
                .map(|m| if total > 0.0 { (m / total) as f32 } else { 0.0 })
                .collect())
        })
    }

    /// Record in the probe the positions of the newest queries of `n` rows from `pos` written
    /// from ring row `ring_at`; the ring row after them.
    pub(super) fn probe_commit(
        session: &mut Session<B>,
        pos: usize,
        n: usize,
        ring_at: usize,
    ) -> usize {
        let m = n.min(PROBE_QUERIES);
        if let Some(p) = &mut session.probe {
            for r in 0..m {
                p.positions[(ring_at + r) % PROBE_QUERIES] = pos + n - m + r;
            }
        }
        (ring_at + m) % PROBE_QUERIES
    }
}
