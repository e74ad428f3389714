//! Layer-major prefill: a call longer than a step, each layer's weights once over the call's rows
//! in groups, the hidden states between layers on the device or in host memory.

use super::scratch::Pass;
use super::session::Session;
use super::step::Logits;
use super::{Engine, EngineError, NonFiniteAt, Result};
use crate::backend::{Backend, HostStage};
use crate::footprint::step_memory;

impl<B: Backend> Engine<B> {
    /// A call longer than a group, layer by layer (see
    /// [`PrefillLayout`](crate::footprint::PrefillLayout)): each layer's weights
    /// once, over the call's rows in groups; the hidden states between layers on the device or
    /// in host memory. The same rows, positions and ops as one step over all of them.
    pub(super) fn layer_major(
        &self,
        pass: &mut Pass<B>,
        session: &mut Session<B>,
        tokens: &[u32],
        logits: Logits,
    ) -> Result<Vec<f32>> {
        let b = &self.backend;
        let spec = &self.spec;
        let (total, d) = (tokens.len(), spec.d_model);
        let group = self.prefill.group;
        let pos = session.pos;
        // Every row's logits come a group at a time.
        let rows = logits.rows(group);
        let mut sc = self.take_scratch(pass, group)?;
        if let Err(e) = self.hold_logits(&mut sc, rows) {
            pass.scratch = Some(sc);
            return Err(e);
        }
        let source = &mut *pass.source;
        let need = step_memory(
            spec,
            group,
            rows,
            self.prefill.joins,
            self.kv_type,
            &source.matmuls(),
            |op| b.workspace_bytes(op),
        );
        b.set_workspace(need.workspace)?;
        let mut hidden = if self.prefill.residual_on_device(total) {
            Hidden::Device(b.alloc(total, d)?)
        } else {
            Hidden::Host(HostStage::new(b, total * d)?)
        };
        let groups: Vec<(usize, usize)> = (0..total)
            .step_by(group)
            .map(|a| (a, group.min(total - a)))
            .collect();
        // The probe ring row each group's queries start at: as if each group were a step.
        let mut ring = Vec::with_capacity(groups.len());
        let mut at = session.probe.as_ref().map_or(0, |p| p.next);
        for &(a, len) in &groups {
            ring.push(at);
            at = Self::probe_commit(session, pos + a, len, at);
        }
        let check_layers = pass.check_layers;
        let run = (|| -> Result<Vec<f32>> {
            let mut non_finite = None;
            for &(a, len) in &groups {
                sc.narrow(b, len)?;
                source.embed(b, &tokens[a..a + len], pos + a, &mut sc.x)?;
                hidden.put(b, &sc.x, a)?;
            }
            for l in 0..spec.n_layers {
                super::trace::set_layer(Some(l));
                {
                    let mut layer = source.layer(b, l)?;
                    // A partitioned call is a prefill: its groups attend on the device.
                    self.kv_layer_begin(session, l, pos, false)?;
                    for (&(a, len), &ring_at) in groups.iter().zip(&ring) {
                        sc.narrow(b, len)?;
                        hidden.get(b, a, &mut sc.x)?;
                        let at = (pos + a, Some(ring_at));
                        self.attention_block(&mut layer, l, session, &mut sc, at, false)?;
                        self.finish_layer(&mut layer, l, &mut sc)?;
                        self.add_residual(&mut sc)?;
                        if check_layers && non_finite.is_none() && !self.all_finite(&sc.x)? {
                            non_finite = Some(l);
                        }
                        hidden.put(b, &sc.x, a)?;
                        if let Some(t) = &self.step_tap {
                            t.group_done(l, a, len);
                        }
                    }
                    self.kv_layer_end(session, l, pos, total, false)?;
                }
                source.layer_done(b, l)?;
            }
            super::trace::set_layer(None);
            if let Some(l) = non_finite {
                return Err(EngineError::NonFinite(NonFiniteAt::Layer(l)));
            }
            let mut out = Vec::new();
            match logits {
                Logits::None => {}
                // The last group's rows are still in `sc.x`.
                Logits::Last => out = self.head_rows(source, &mut sc, 1)?,
                Logits::All => {
                    for &(a, len) in &groups {
                        sc.narrow(b, len)?;
                        hidden.get(b, a, &mut sc.x)?;
                        out.extend(self.head_rows(source, &mut sc, len)?);
                    }
                }
            }
            Ok(out)
        })();
        // The buffers go back at their full size whatever happened.
        let narrowed = sc.narrow(b, group);
        pass.scratch = Some(sc);
        let out = run?;
        narrowed?;
        if let Some(p) = &mut session.probe {
            p.next = at;
        }
        session.pos += total;
        Ok(out)
    }
}

/// The hidden states of a partitioned call between layers: `rows × d_model` f32.
enum Hidden<B: Backend> {
    Device(B::Tensor),
    Host(HostStage),
}

impl<B: Backend> Hidden<B> {
    /// Rows `first..first + rows of x` from `x`.
    fn put(&mut self, b: &B, x: &B::Tensor, first: usize) -> Result<()> {
        let (rows, d) = b.shape(x);
        match self {
            Hidden::Device(t) => b.copy_rows(x, 0, t, first, rows)?,
            Hidden::Host(h) => b.read(x, &mut h.values_mut()[first * d..(first + rows) * d])?,
        }
        Ok(())
    }

    /// Rows `first..first + rows of x` into `x`.
    fn get(&self, b: &B, first: usize, x: &mut B::Tensor) -> Result<()> {
        let (rows, d) = b.shape(x);
        match self {
            Hidden::Device(t) => b.copy_rows(t, first, x, 0, rows)?,
            Hidden::Host(h) => b.write(x, &h.values()[first * d..(first + rows) * d])?,
        }
        Ok(())
    }
}
