//! A layer's attention: its inputs (norm, q, k, v), the rotation and the store of the step's keys
//! and values in the session's cache, and the attention over that cache: on the device, on the
//! CPU over a host-kept cache, or every call of a batched step in one backend call.

use std::sync::Arc;

use super::kv_pool::lock_pool;
use super::ports::LayerView;
use super::scratch::Scratch;
use super::session::{Session, SessionKv};
use super::{Engine, EngineError, Result};
use crate::backend::{AttnSeq, AttnShape, Backend, Rope};

impl<B: Backend> Engine<B> {
    /// The attention block's inputs from `sc.x` (the last layer's residual added first): its
    /// norm (into `sc.h`, where the backend writes it out), then q, k and v, and where the
    /// model norms each head of q and k (Qwen3), those norms.
    pub(super) fn attention_inputs(&self, layer: &LayerView<B>, sc: &mut Scratch<B>) -> Result<()> {
        let add = std::mem::take(&mut sc.residual).then_some(&sc.proj);
        let input = self.norm_input(&mut sc.x, add, &layer.attn_norm, &mut sc.h)?;
        let outs: &mut [&mut B::Tensor] = &mut [&mut sc.q, &mut sc.k, &mut sc.v];
        self.linears(&[&layer.wq, &layer.wk, &layer.wv], input, outs)?;
        if let Some([qn, kn]) = layer.qk_norm {
            let (hd, eps) = (self.spec.head_dim, self.spec.norm_eps);
            self.backend.rms_norm_heads(&mut sc.q, qn, hd, eps)?;
            self.backend.rms_norm_heads(&mut sc.k, kn, hd, eps)?;
        }
        Ok(())
    }

    /// Rotate a step's queries and keys (rows from position `pos`), where the model rotates.
    pub(super) fn rope_qk(&self, q: &mut B::Tensor, k: &mut B::Tensor, pos: usize) -> Result<()> {
        if let Some(r) = self.rope_args() {
            let (hd, rd, pairs, f) = (r.head_dim, r.rot_dims, r.pairs, r.inv_freq);
            self.backend.rope_pair(q, k, hd, rd, pairs, f, pos)?;
        }
        Ok(())
    }

    /// The model's rotary embedding as the ops take it (none where it does not rotate).
    fn rope_args(&self) -> Option<Rope<'_, B::Weight>> {
        self.rope.as_ref().map(|(inv_freq, pairs, dims)| Rope {
            head_dim: self.spec.head_dim,
            rot_dims: *dims,
            pairs: *pairs,
            inv_freq,
        })
    }

    /// Layer `l`'s cached keys and values before position `pos` asked for at the start of the
    /// layer, so they arrive while its products run (a decode step's row attends them after
    /// q, k and v are made; the store of this step's row lands on lines already there).
    /// SmolLM2 hybrid at 48M (sim, traced, alternated 4 times): the attend step 8.4–11.3 µs a
    /// layer against 10.4–14.3 without, rope and store 0.9–1.5 against 1.9–2.6. A host-kept
    /// cache's work copy was just written ([`Engine::kv_layer_begin`]); a paged one's blocks
    /// lie apart.
    pub(super) fn prefetch_kv(&self, s: &Session<B>, l: usize, pos: usize) {
        if let SessionKv::Device { k, v } = &s.kv {
            self.backend.prefetch_kv(&k[l], &v[l], pos);
        }
    }

    /// Attend `q` (positions `pos..`) over the session's layer `l` cache into `out`: on the
    /// device, over the keys and values [`Engine::rope_and_store`] stored, or (`on_cpu`, a
    /// host-kept cache) on the CPU over the host copy, storing `k` and `v` there first.
    pub(super) fn attend(
        &self,
        s: &mut Session<B>,
        l: usize,
        pos: usize,
        (q, k, v): (&B::Tensor, &B::Tensor, &B::Tensor),
        out: &mut B::Tensor,
        on_cpu: bool,
    ) -> Result<()> {
        let b = &self.backend;
        let n = b.shape(q).0;
        if Self::attends_on_host(s, on_cpu)
            && let SessionKv::Host(h) = &mut s.kv
        {
            let spec = &self.spec;
            let (qd, kd) = (spec.q_dim(), spec.kv_dim());
            let mut qh = vec![0f32; n * qd];
            let mut kh = vec![0f32; n * kd];
            let mut vh = vec![0f32; n * kd];
            b.read(q, &mut qh)?;
            b.read(k, &mut kh)?;
            b.read(v, &mut vh)?;
            let rb = h.row_bytes;
            let rows = pos * rb..(pos + n) * rb;
            h.k[l].bytes_mut()[rows.clone()].copy_from_slice(&crate::backend::cpu::encode_rows(
                self.kv_type,
                &kh,
                kd,
            ));
            h.v[l].bytes_mut()[rows].copy_from_slice(&crate::backend::cpu::encode_rows(
                self.kv_type,
                &vh,
                kd,
            ));
            let mut o = vec![0f32; n * qd];
            crate::backend::cpu::attend_rows(
                self.kv_type,
                (h.k[l].bytes(), h.v[l].bytes()),
                &qh,
                pos,
                self.attn_shape(),
                &mut o,
            );
            b.write(out, &o)?;
            return Ok(());
        }
        let shape = self.attn_shape();
        match &s.kv {
            SessionKv::Paged(p) => {
                let pool = lock_pool(&p.pool);
                b.attention(q, &pool.k[l], &pool.v[l], Some(&p.table), pos, shape, out)?;
            }
            SessionKv::Device { k: kc, v: vc } => {
                b.attention(q, &kc[l], &vc[l], None, pos, shape, out)?;
            }
            SessionKv::Host(h) => {
                b.attention(q, &h.work_k, &h.work_v, None, pos, shape, out)?;
            }
        }
        Ok(())
    }

    /// Whether a step's attention runs on the CPU over a host-kept cache (`on_cpu`, the
    /// prefill layout's choice, where the session keeps its cache on the host).
    pub(super) fn attends_on_host(s: &Session<B>, on_cpu: bool) -> bool {
        on_cpu && matches!(s.kv, SessionKv::Host(_))
    }

    /// Rotate a step's queries and keys (rows from position `pos`, where the model rotates) and
    /// store the keys and values in the session's layer `l` cache (a host-kept session: in its
    /// work buffers, which hold the layer from `kv_layer_begin`): one op (one kernel on CUDA for
    /// f32 and f16 caches).
    pub(super) fn rope_and_store(
        &self,
        s: &mut Session<B>,
        l: usize,
        pos: usize,
        (q, k, v): (&mut B::Tensor, &mut B::Tensor, &B::Tensor),
    ) -> Result<()> {
        let b = &self.backend;
        let rope = self.rope_args();
        let store = |caches: (&mut B::Kv, &mut B::Kv), table: Option<&B::KvTable>| match rope {
            Some(r) => b.rope_store_kv((q, k, v), caches, table, pos, r),
            None => b.store_kv_pair((k, v), caches, table, pos),
        };
        match &mut s.kv {
            SessionKv::Paged(p) => {
                self.sync_table(p)?;
                let mut pool = lock_pool(&p.pool);
                let pool = &mut *pool;
                store((&mut pool.k[l], &mut pool.v[l]), Some(&p.table))?;
            }
            SessionKv::Device { k: kc, v: vc } => store((&mut kc[l], &mut vc[l]), None)?,
            SessionKv::Host(h) => store((&mut h.work_k, &mut h.work_v), None)?,
        }
        Ok(())
    }

    /// Whether a step's calls attend in one backend call: the backend can, none attends on the
    /// CPU beside the device, and their paged caches are this engine's pool (locked once).
    pub(super) fn attends_together(&self, calls: &[(&mut Session<B>, &[u32])]) -> bool {
        self.backend.attends_batches()
            && calls.iter().all(|(s, t)| match &s.kv {
                SessionKv::Device { .. } => true,
                SessionKv::Host(_) => !self.prefill.attends_on_cpu(t.len()),
                SessionKv::Paged(p) => self.pool.as_ref().is_some_and(|e| Arc::ptr_eq(e, &p.pool)),
            })
    }

    /// Layer `l`'s attention of every call's rows of `q` (call `i`'s from `firsts[i]`, already
    /// rotated, its keys and values stored) into the same rows of `out`, in one backend call.
    pub(super) fn attend_together(
        &self,
        calls: &[(&mut Session<B>, &[u32])],
        firsts: &[usize],
        l: usize,
        q: &B::Tensor,
        out: &mut B::Tensor,
    ) -> Result<()> {
        let paged = calls
            .iter()
            .any(|(s, _)| matches!(s.kv, SessionKv::Paged(_)));
        let pool = self.pool.as_ref().filter(|_| paged).map(lock_pool);
        let mut seqs = Vec::with_capacity(calls.len());
        for ((s, t), &first_row) in calls.iter().zip(firsts) {
            let (k, v, table) = match &s.kv {
                SessionKv::Device { k, v } => (&k[l], &v[l], None),
                SessionKv::Host(h) => (&h.work_k, &h.work_v, None),
                SessionKv::Paged(p) => {
                    let pool = pool.as_ref().ok_or_else(|| {
                        EngineError::Weights("a paged session without the engine's pool".into())
                    })?;
                    (&pool.k[l], &pool.v[l], Some(&p.table))
                }
            };
            seqs.push(AttnSeq {
                first_row,
                rows: t.len(),
                first_pos: s.pos,
                k,
                v,
                table,
            });
        }
        self.backend
            .attention_batch(q, &seqs, self.attn_shape(), out)?;
        Ok(())
    }

    /// The attention shape of every layer.
    fn attn_shape(&self) -> AttnShape {
        let spec = &self.spec;
        AttnShape {
            n_heads: spec.n_heads,
            n_kv_heads: spec.n_kv_heads,
            head_dim: spec.head_dim,
            scale: spec.attn_scale,
        }
    }
}
