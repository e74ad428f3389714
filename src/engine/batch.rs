//! Continuous batching: one step over several sessions, each call's tokens at its own positions
//! over its own cache, the weights passing once for all of them.

use super::ports::LayerView;
use super::scratch::{Pass, Scratch};
use super::session::Session;
use super::step::Logits;
use super::{Engine, EngineError, Result};
use crate::backend::Backend;
use crate::footprint::{PROBE_QUERIES, step_memory};

impl<B: Backend> Engine<B> {
    /// The next token of each session, evaluated in one step (continuous batching): see
    /// [`Engine::step_many`].
    pub fn decode_many(&self, calls: &mut [(&mut Session<B>, u32)]) -> Result<Vec<Vec<f32>>> {
        let tokens: Vec<[u32; 1]> = calls.iter().map(|(_, t)| [*t]).collect();
        let mut calls: Vec<(&mut Session<B>, &[u32])> = calls
            .iter_mut()
            .zip(&tokens)
            .map(|((s, _), t)| (&mut **s, &t[..]))
            .collect();
        self.step_many(&mut calls)
    }

    /// One step over several sessions (continuous batching): each call's tokens — the next
    /// token of a sequence being decoded, or a whole prompt joining the step — are evaluated at
    /// that session's positions, over its own cache; the weights pass once for all of them.
    /// Returns each call's logits of its last token: what its tokens get alone, bit for bit on
    /// the CPU and the budgeted device. All the calls' tokens together are at most one step
    /// (`PrefillLayout::group`); a session appears once.
    pub fn step_many(&self, calls: &mut [(&mut Session<B>, &[u32])]) -> Result<Vec<Vec<f32>>> {
        if calls.is_empty() {
            return Ok(Vec::new());
        }
        for (s, toks) in calls.iter() {
            if toks.is_empty() {
                return Err(EngineError::Empty);
            }
            if s.pos + toks.len() > s.ctx {
                return Err(EngineError::ContextFull {
                    needed: s.pos + toks.len(),
                    ctx: s.ctx,
                });
            }
            if let Some(&id) = toks.iter().find(|&&t| t as usize >= self.spec.vocab_size) {
                return Err(EngineError::InvalidToken {
                    id,
                    vocab: self.spec.vocab_size,
                });
            }
        }
        if !self.prefill.joins
            && calls.len() > 1
            && let Some((_, t)) = calls.iter().find(|(_, t)| t.len() > 1)
        {
            return Err(EngineError::Weights(format!(
                "a call of {} tokens beside others in one step: this engine's plan buffers one token a call (plan several sequences for prompts to join)",
                t.len()
            )));
        }
        if let [(s, toks)] = calls
            && self.record_steps
            && toks.len() == 1
        {
            // One token of one sequence (a server with one client decoding): its own step,
            // recorded and replayed; the same logits, as a batched step gives each call what it
            // gets alone.
            return Ok(vec![self.forward(s, toks, Logits::Last)?]);
        }
        let n: usize = calls.iter().map(|(_, t)| t.len()).sum();
        if n > self.prefill.group {
            return Err(EngineError::Weights(format!(
                "{n} tokens of {} sequences in one step; the step holds {}",
                calls.len(),
                self.prefill.group
            )));
        }
        let mut want: Vec<(&mut Session<B>, usize)> = calls
            .iter_mut()
            .map(|(s, t)| {
                let rows = s.pos + t.len();
                (&mut **s, rows)
            })
            .collect();
        self.take_blocks(&mut want)?;
        let mut guard = self
            .pass
            .lock()
            .map_err(|_| EngineError::Weights("an earlier pass panicked".into()))?;
        let pass: &mut Pass<B> = &mut guard;
        self.backend.enter(|| self.batched_step(pass, calls, n))
    }

    fn batched_step(
        &self,
        pass: &mut Pass<B>,
        calls: &mut [(&mut Session<B>, &[u32])],
        n: usize,
    ) -> Result<Vec<Vec<f32>>> {
        let b = &self.backend;
        let spec = &self.spec;
        let m = calls.len();
        // Each call's first row in the step; the rows whose logits come back (each call's last).
        let firsts: Vec<usize> = calls
            .iter()
            .scan(0, |r, (_, t)| {
                let f = *r;
                *r += t.len();
                Some(f)
            })
            .collect();
        let lasts: Vec<usize> = calls
            .iter()
            .zip(&firsts)
            .map(|((_, t), f)| f + t.len() - 1)
            .collect();
        let mut sc = self.take_scratch(pass, n)?;
        if let Err(e) = self.hold_logits(&mut sc, m) {
            pass.scratch = Some(sc);
            return Err(e);
        }
        let source = &mut *pass.source;
        let joins = self.prefill.joins;
        let need = step_memory(spec, n, m, joins, self.kv_type, &source.matmuls(), |op| {
            b.workspace_bytes(op)
        });
        b.set_workspace(need.workspace)?;
        let run = (|| -> Result<Vec<f32>> {
            // Embed each call's tokens at its own positions (learned position tables differ
            // per row).
            for ((s, t), &first) in calls.iter().zip(&firsts) {
                b.reshape(&mut sc.h, t.len(), spec.d_model)?;
                source.embed(b, t, s.pos, &mut sc.h)?;
                b.copy_rows(&sc.h, 0, &mut sc.x, first, t.len())?;
            }
            b.reshape(&mut sc.h, n, spec.d_model)?;
            for l in 0..spec.n_layers {
                {
                    let mut layer = source.layer(b, l)?;
                    self.batched_attention(calls, &firsts, l, &layer, &mut sc)?;
                    self.finish_layer(&mut layer, l, &mut sc)?;
                    if let Some(t) = &self.step_tap {
                        t.group_done(l, 0, n);
                    }
                }
                source.layer_done(b, l)?;
            }
            self.add_residual(&mut sc)?;
            self.head_of(source, &mut sc, &lasts)
        })();
        pass.scratch = Some(sc);
        let logits = run?;
        for (s, t) in calls.iter_mut() {
            let k = t.len();
            let next = Self::probe_commit(s, s.pos, k, s.probe.as_ref().map_or(0, |p| p.next));
            if let Some(p) = &mut s.probe {
                p.next = next;
            }
            s.pos += k;
        }
        Ok(logits.chunks(spec.vocab_size).map(|r| r.to_vec()).collect())
    }

    /// Layer `l`'s attention over the step's rows, call `i`'s from row `firsts[i]`: q, k and v
    /// of all of them, then each call's rows rotated and stored in its own caches (its newest
    /// queries into its probe's ring) and attended over them into the same rows of `sc.attn`.
    fn batched_attention(
        &self,
        calls: &mut [(&mut Session<B>, &[u32])],
        firsts: &[usize],
        l: usize,
        layer: &LayerView<B>,
        sc: &mut Scratch<B>,
    ) -> Result<()> {
        let b = &self.backend;
        let spec = &self.spec;
        self.attention_inputs(layer, sc)?;
        // All the calls' attention in one backend call where it can (each call's
        // rows over its own caches, as alone), else call by call.
        let together = self.attends_together(calls);
        for ((s, t), &first) in calls.iter_mut().zip(firsts) {
            let (pos, k) = (s.pos, t.len());
            let [qc, kc, vc, ac] = &mut sc.row;
            for (buf, cols) in [
                (&mut *qc, spec.q_dim()),
                (&mut *kc, spec.kv_dim()),
                (&mut *vc, spec.kv_dim()),
                (&mut *ac, spec.q_dim()),
            ] {
                b.reshape(buf, k, cols)?;
            }
            b.copy_rows(&sc.q, first, qc, 0, k)?;
            b.copy_rows(&sc.k, first, kc, 0, k)?;
            b.copy_rows(&sc.v, first, vc, 0, k)?;
            let on_cpu = self.prefill.attends_on_cpu(k);
            self.kv_layer_begin(s, l, pos, on_cpu)?;
            if Self::attends_on_host(s, on_cpu) {
                self.rope_qk(qc, kc, pos)?;
            } else {
                self.rope_and_store(s, l, pos, (qc, kc, vc))?;
            }
            let ring_at = s.probe.as_ref().map_or(0, |p| p.next);
            if let Some(p) = &mut s.probe
                && let Some(pi) = p.layers.iter().position(|&pl| pl == l)
            {
                // The last queries of the call's rows go into the ring, oldest first.
                let r = k.min(PROBE_QUERIES);
                for j in 0..r {
                    let row = (ring_at + j) % PROBE_QUERIES;
                    b.copy_rows(qc, k - r + j, &mut p.q[pi], row, 1)?;
                }
            }
            if together {
                // The rotated queries go back to the step's rows.
                b.copy_rows(qc, 0, &mut sc.q, first, k)?;
                continue;
            }
            self.attend(s, l, pos, (qc, kc, vc), ac, on_cpu)?;
            self.kv_layer_end(s, l, pos, k, on_cpu)?;
            b.copy_rows(ac, 0, &mut sc.attn, first, k)?;
        }
        if together {
            self.attend_together(calls, firsts, l, &sc.q, &mut sc.attn)?;
            for (s, t) in calls.iter_mut() {
                self.kv_layer_end(s, l, s.pos, t.len(), false)?;
            }
        }
        Ok(())
    }
}
