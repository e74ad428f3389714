//! A forward step of one session: its checks, the step buffers taken from the pass, every layer
//! once over the step's rows (attention, then the FFN), the head; and the device memory such a
//! step holds. Calls longer than a step go to `prefill`, recorded decode steps to `recorded`,
//! several sessions' steps to `batch`.

use super::ffn::FfnSite;
use super::ports::LayerView;
use super::scratch::{Pass, Scratch};
use super::session::Session;
use super::trace::{self, Phase};
use super::{Engine, EngineError, NonFiniteAt, Result};
use crate::backend::Backend;
use crate::footprint::{PROBE_QUERIES, StepMemory, step_memory, whole_device_group};

/// Which positions' logits a forward step returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    /// Only the last token's (generation).
    Last,
    /// Every token's (scoring, perplexity).
    All,
    /// None (prefill of a prefix whose next token is already known).
    None,
}

impl Logits {
    /// Logit rows a step of `n` rows returns.
    pub(super) fn rows(self, n: usize) -> usize {
        match self {
            Logits::None => 0,
            Logits::Last => 1,
            Logits::All => n,
        }
    }
}

impl<B: Backend> Engine<B> {
    /// Evaluate `tokens` after what the session holds; returns logits (`vocab` values per
    /// returned position, row-major).
    pub fn forward(
        &self,
        session: &mut Session<B>,
        tokens: &[u32],
        logits: Logits,
    ) -> Result<Vec<f32>> {
        let t0 = std::time::Instant::now();
        if tokens.is_empty() {
            return Err(EngineError::Empty);
        }
        let needed = session.pos + tokens.len();
        if needed > session.ctx {
            return Err(EngineError::ContextFull {
                needed,
                ctx: session.ctx,
            });
        }
        if let Some(&id) = tokens.iter().find(|&&t| t as usize >= self.spec.vocab_size) {
            return Err(EngineError::InvalidToken {
                id,
                vocab: self.spec.vocab_size,
            });
        }
        self.take_blocks(&mut [(&mut *session, needed)])?;
        let mut guard = self
            .pass
            .lock()
            .map_err(|_| EngineError::Weights("an earlier pass panicked".into()))?;
        let pass: &mut Pass<B> = &mut guard;
        // Checked once a step: the step's thread reports its phases only when traced.
        let trace = pass.trace.clone();
        if let Some(t) = &trace {
            t.begin_step(tokens.len(), t0);
        }
        let (pos, ring_next) = (session.pos, session.probe.as_ref().map(|p| p.next));
        let run = |pass: &mut Pass<B>, session: &mut Session<B>, traced: bool| {
            self.backend.enter(|| {
                let _on = trace.as_ref().filter(|_| traced).map(|t| t.activate());
                if self.prefill.partitions(tokens.len()) {
                    self.layer_major(pass, session, tokens, logits)
                } else {
                    self.step(pass, session, tokens, logits)
                }
            })
        };
        let mut out = run(pass, session, true);
        if let Some(t) = &trace {
            t.end_step();
        }
        if let Err(EngineError::NonFinite(NonFiniteAt::Logits)) = out {
            // Locate it: the same call again from the same position (same values, the same KV
            // rows rewritten), the hidden state checked after every layer.
            let rewind = |session: &mut Session<B>| {
                session.pos = pos;
                if let (Some(p), Some(next)) = (&mut session.probe, ring_next) {
                    p.next = next;
                }
            };
            rewind(session);
            pass.check_layers = true;
            let again = run(pass, session, false);
            pass.check_layers = false;
            rewind(session);
            let at = match again {
                Err(EngineError::NonFinite(NonFiniteAt::Layer(l))) => NonFiniteAt::Layer(l),
                Err(EngineError::NonFinite(_)) => NonFiniteAt::Head,
                // Not reproduced: where is not known.
                _ => NonFiniteAt::Logits,
            };
            out = Err(EngineError::NonFinite(at));
        }
        out
    }

    /// The step buffers viewed as `n` rows: the last step's where they hold that many (a
    /// step's memory is held, not reallocated, as calls of other sizes come and go: no churn, no
    /// fragments), else fresh ones (the old freed first: device memory is budgeted).
    pub(super) fn take_scratch(&self, pass: &mut Pass<B>, n: usize) -> Result<Scratch<B>> {
        match pass.scratch.take() {
            Some(mut sc) if sc.cap >= n => match sc.narrow(&self.backend, n) {
                Ok(()) => {
                    // A step that failed may have left its residual pending.
                    sc.residual = false;
                    Ok(sc)
                }
                Err(e) => {
                    pass.scratch = Some(sc);
                    Err(e)
                }
            },
            old => {
                drop(old);
                self.backend.set_workspace(0)?;
                Scratch::new(&self.backend, &self.spec, n, self.prefill.joins)
            }
        }
    }

    /// One forward step: every layer once over all of `tokens` (at most a group).
    fn step(
        &self,
        pass: &mut Pass<B>,
        session: &mut Session<B>,
        tokens: &[u32],
        logits: Logits,
    ) -> Result<Vec<f32>> {
        let n = tokens.len();
        let b = &self.backend;
        let spec = &self.spec;
        let pos = session.pos;
        let rows = logits.rows(n);
        let mut sc = self.take_scratch(pass, n)?;
        self.hold_logits(&mut sc, rows)?;
        let source = &mut *pass.source;
        // The workspace the ops of this step need, by the formula the planner used.
        let joins = self.prefill.joins;
        let need = step_memory(
            spec,
            n,
            rows,
            joins,
            self.kv_type,
            &source.matmuls(),
            |op| b.workspace_bytes(op),
        );
        b.set_workspace(need.workspace)?;

        let on_cpu = self.prefill.attends_on_cpu(n);
        let check_layers = pass.check_layers;
        let mut non_finite = None;
        if !check_layers && self.records(session, &*source, n, rows, on_cpu) {
            let out = self.recorded_step(source, session, &mut sc, tokens);
            pass.scratch = Some(sc);
            return out;
        }
        // The device's streams timed from here (not in a recorded step: captured, not run).
        trace::device_clock(|| b.device_clock());
        {
            let _s = trace::span(Phase::Embed);
            source.embed(b, tokens, pos, &mut sc.x)?;
        }
        let ring_at = session.probe.as_ref().map_or(0, |p| p.next);
        if spec.n_layers > 0 {
            trace::set_layer(Some(0));
            let _s = trace::span(Phase::Attention);
            self.kv_layer_begin(session, 0, pos, on_cpu)?;
        }
        for l in 0..spec.n_layers {
            trace::set_layer(Some(l));
            {
                let mut layer = source.layer(b, l)?;
                let at = (pos, Some(ring_at));
                self.attention_block(&mut layer, l, session, &mut sc, at, on_cpu)?;
                {
                    // A host-kept cache's new rows go back, and the next layer's rows go up into
                    // the work buffers this layer's attention has done with, before the FFN is
                    // queued. After it, the read waited for the FFN's device work too (a cache
                    // unit's in-place reads) with the host queuing nothing, and the rows going
                    // up crossed the link behind the slot refill queued at the layer's end,
                    // holding the next attention back until both had crossed.
                    let _s = trace::span(Phase::Attention);
                    self.kv_layer_end(session, l, pos, n, on_cpu)?;
                    if l + 1 < spec.n_layers {
                        self.kv_layer_begin(session, l + 1, pos, on_cpu)?;
                    }
                }
                self.finish_layer(&mut layer, l, &mut sc)?;
                if let Some(t) = &self.step_tap {
                    t.group_done(l, 0, n);
                }
            }
            source.layer_done(b, l)?;
            if check_layers && non_finite.is_none() {
                self.add_residual(&mut sc)?;
                if !self.all_finite(&sc.x)? {
                    non_finite = Some(l);
                }
            }
        }
        trace::set_layer(None);
        self.add_residual(&mut sc)?;
        if let Some(l) = non_finite {
            pass.scratch = Some(sc);
            return Err(EngineError::NonFinite(NonFiniteAt::Layer(l)));
        }
        let next = Self::probe_commit(session, pos, n, ring_at);
        if let Some(p) = &mut session.probe {
            p.next = next;
        }
        session.pos += n;

        let out = if rows == 0 {
            Ok(Vec::new())
        } else {
            let _s = trace::span(Phase::Head);
            self.head_rows(source, &mut sc, rows)
        };
        pass.scratch = Some(sc);
        out
    }

    /// Layer `l`'s attention over the rows of `sc.x` (the step's `n` rows, row `i` at position
    /// `pos + i`), up to its output in `sc.attn`: q, k and v, the rows' keys and values stored,
    /// the attention; [`Self::finish_layer`] then adds it and the FFN to `sc.x`. The newest
    /// queries go into the session's probe from ring row `ring_at`, or (`None`, a recorded
    /// step's one row) into its staging row.
    pub(super) fn attention_block(
        &self,
        layer: &mut LayerView<B>,
        l: usize,
        session: &mut Session<B>,
        sc: &mut Scratch<B>,
        (pos, ring_at): (usize, Option<usize>),
        on_cpu: bool,
    ) -> Result<()> {
        let b = &self.backend;
        let n = sc.n;
        let attention = trace::span(Phase::Attention);
        if n == 1 {
            self.prefetch_kv(session, l, pos);
        }

        // Attention block: q, k and v; q and k rotated, k and v stored (on the host for a
        // host-kept cache attended on the CPU).
        self.attention_inputs(layer, sc)?;
        if Self::attends_on_host(session, on_cpu) {
            self.rope_qk(&mut sc.q, &mut sc.k, pos)?;
        } else {
            self.rope_and_store(session, l, pos, (&mut sc.q, &mut sc.k, &sc.v))?;
        }
        if let Some(p) = &mut session.probe
            && let Some(i) = p.layers.iter().position(|&pl| pl == l)
        {
            match ring_at {
                // The last queries of these rows go into the ring, oldest first.
                Some(at) => {
                    let m = n.min(PROBE_QUERIES);
                    for r in 0..m {
                        let row = (at + r) % PROBE_QUERIES;
                        b.copy_rows(&sc.q, n - m + r, &mut p.q[i], row, 1)?;
                    }
                }
                // A recorded step's one query: to the fixed staging row.
                None => b.copy_rows(&sc.q, n - 1, &mut p.staged[i], 0, 1)?,
            }
        }
        self.attend(session, l, pos, (&sc.q, &sc.k, &sc.v), &mut sc.attn, on_cpu)?;
        drop(attention);
        Ok(())
    }

    /// The rest of layer `l` once `sc.attn` holds the attention output: the output projection
    /// added to `sc.x`, then the FFN, left in `sc.proj` for the next layer's norm to add
    /// (`sc.residual`).
    pub(super) fn finish_layer(
        &self,
        layer: &mut LayerView<B>,
        l: usize,
        sc: &mut Scratch<B>,
    ) -> Result<()> {
        if layer.router.is_none() && self.spec.moe.is_some() {
            return Err(EngineError::Weights(format!(
                "layer {l} of a mixture-of-experts model came without its router"
            )));
        }
        let site = FfnSite::of(&mut layer.cold, &mut layer.unit);
        let on_device = matches!(site, FfnSite::Device);
        // A mixture-of-experts layer's matrices hold every expert: never one dense product.
        let fused = self
            .whole_gated_ffn(&layer.ffn, !on_device)
            .filter(|_| layer.router.is_none());
        match fused {
            // One op from the residual add to the FFN's output, so the norm's rows can go
            // straight into the products' input: the attention's projection goes to `sc.h` (free
            // once q, k and v are made) for the norm to add, and `sc.attn` (read by then) is the
            // norm's own scratch, where the backend writes its rows out.
            Some(ws) if self.spec.q_dim() == self.spec.d_model => {
                {
                    let _s = trace::span(Phase::Attention);
                    self.linear(&layer.wo, &sc.attn, &mut sc.h)?;
                }
                let _s = trace::span(Phase::DeviceNeurons);
                let threshold = self.thresholds.get(l).copied().unwrap_or(0.0);
                let gate = sc.gate.as_mut().ok_or_else(|| {
                    EngineError::Weights("a gated FFN without its gate buffer".into())
                })?;
                let input =
                    self.norm_input(&mut sc.x, Some(&sc.h), &layer.ffn_norm, &mut sc.attn)?;
                let how = (self.act, threshold);
                self.backend
                    .gate_up_down(input, ws, how, (gate, &mut sc.up), &mut sc.proj)?;
            }
            _ => {
                {
                    let _s = trace::span(Phase::Attention);
                    self.linear(&layer.wo, &sc.attn, &mut sc.proj)?;
                    // The residual add, and the feed-forward block's norm.
                    self.add_norm(&mut sc.x, &sc.proj, &layer.ffn_norm, &mut sc.h)?;
                }
                match layer.router {
                    Some(router) => {
                        let _s = trace::span(Phase::DeviceNeurons);
                        self.moe_ffn(l, &layer.ffn, router, layer.experts.as_mut(), sc)?;
                    }
                    None => self.ffn(l, &layer.ffn, site, sc)?,
                }
            }
        }
        sc.residual = true;
        Ok(())
    }

    /// Add the last layer's residual to `sc.x` if it is pending: before anything but the next
    /// layer reads `sc.x`.
    pub(super) fn add_residual(&self, sc: &mut Scratch<B>) -> Result<()> {
        if std::mem::take(&mut sc.residual) {
            self.backend.add(&mut sc.x, &sc.proj)?;
        }
        Ok(())
    }

    /// `f` given the device memory a step of `n` tokens returning `logit_rows` logit rows holds,
    /// as `(n, logit_rows) -> StepMemory` (the weights' shapes read once).
    fn with_step_memory<R>(
        &self,
        f: impl FnOnce(&dyn Fn(usize, usize) -> StepMemory) -> R,
    ) -> Result<R> {
        let pass = self
            .pass
            .lock()
            .map_err(|_| EngineError::Weights("an earlier pass panicked".into()))?;
        let matmuls = pass.source.matmuls();
        Ok(f(&|n, logit_rows| {
            step_memory(
                &self.spec,
                n,
                logit_rows,
                self.prefill.joins,
                self.kv_type,
                &matmuls,
                |op| self.backend.workspace_bytes(op),
            )
        }))
    }

    /// The device memory a step of `n` tokens returning `logit_rows` logit rows holds.
    pub fn step_memory(&self, n: usize, logit_rows: usize) -> Result<StepMemory> {
        self.with_step_memory(|step| step(n, logit_rows))
    }

    /// The prefill step [`whole_device_group`] picks for this engine's own step memory: the
    /// longest call (`prompt` tokens) in one step of at most `cap` rows whose buffers (with
    /// `logit_rows` rows of logits) fit in `room` bytes.
    pub fn whole_model_group(
        &self,
        prompt: usize,
        cap: usize,
        room: u64,
        logit_rows: usize,
    ) -> Result<usize> {
        self.with_step_memory(|step| {
            whole_device_group(prompt, cap, room, |g| step(g, logit_rows.min(g)).total())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::Logits;

    #[test]
    fn logits_rows_are_none_the_last_or_every_row() {
        for n in [1, 7, 512] {
            assert_eq!(Logits::None.rows(n), 0);
            assert_eq!(Logits::Last.rows(n), 1);
            assert_eq!(Logits::All.rows(n), n);
        }
    }
}
