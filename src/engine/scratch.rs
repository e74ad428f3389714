//! The buffers of one forward step: the activations of its rows, the logits buffers of its last
//! rows, the host stage a hybrid layer's FFN input lands in; made for a number of rows and viewed
//! as fewer, held between steps by the pass. Shapes only: when a step takes, keeps or replaces
//! them is the engine's.

use super::error::{EngineError, Result};
use super::ports::WeightSource;
use crate::backend::{Backend, HostStage};
use crate::footprint::step::{activation_shapes, logit_shapes};
use crate::model::ModelSpec;

/// What one pass at a time holds: the weight source (a streaming one's buffers are shared by all
/// sessions) and the step buffers.
pub(super) struct Pass<B: Backend> {
    pub(super) source: Box<dyn WeightSource<B>>,
    /// The buffers of the last step, reused while steps keep their size.
    pub(super) scratch: Option<Scratch<B>>,
    /// Where steps report their phases ([`crate::engine::Engine::set_trace`]); none: untraced.
    pub(super) trace: Option<std::sync::Arc<super::trace::StepTrace>>,
    /// Check the hidden state after every layer for non-finite values (only while locating
    /// where a pass whose logits were non-finite went wrong: it reads the state back).
    pub(super) check_layers: bool,
}

/// Activation buffers for one forward step of `n` tokens, and the logits buffers of its last
/// `logit_rows` rows (when it returns logits).
pub(super) struct Scratch<B: Backend> {
    /// Rows the buffers are viewed as now ([`Scratch::narrow`]) and were allocated with.
    pub(super) n: usize,
    pub(super) cap: usize,
    pub(super) x: B::Tensor,
    pub(super) h: B::Tensor,
    pub(super) q: B::Tensor,
    pub(super) k: B::Tensor,
    pub(super) v: B::Tensor,
    pub(super) attn: B::Tensor,
    pub(super) proj: B::Tensor,
    pub(super) up: B::Tensor,
    pub(super) gate: Option<B::Tensor>,
    /// One call's rows of q, k, v and attention output (a batched step's calls, one at a time).
    pub(super) row: [B::Tensor; 4],
    pub(super) logits: Option<LogitBuffers<B>>,
    /// Where hybrid layers' FFN inputs land on the host (made at the first hybrid layer).
    pub(super) stage: Option<HostStage>,
    /// `proj` holds a layer's last residual, not yet added to `x`: the next layer adds it in
    /// its norm (one op); before anything else reads `x`, `Engine::add_residual`.
    pub(super) residual: bool,
}

pub(super) struct LogitBuffers<B: Backend> {
    pub(super) rows: usize,
    pub(super) last: B::Tensor,
    pub(super) normed: B::Tensor,
    pub(super) logits: B::Tensor,
}

impl<B: Backend> Scratch<B> {
    /// Fresh step buffers of `n` rows on `b` (the shapes [`activation_shapes`] gives `spec`;
    /// `joins`: the prefill layout lets prompts join a batched step).
    pub(super) fn new(b: &B, spec: &ModelSpec, n: usize, joins: bool) -> Result<Self> {
        let mut bufs = activation_shapes(spec, n, joins)
            .into_iter()
            .map(|(r, c)| b.alloc(r, c))
            .collect::<std::result::Result<Vec<_>, _>>()?
            .into_iter();
        let mut next = || {
            bufs.next()
                .ok_or_else(|| EngineError::Weights("activation buffers miscounted".into()))
        };
        Ok(Scratch {
            n,
            cap: n,
            x: next()?,
            h: next()?,
            q: next()?,
            k: next()?,
            v: next()?,
            attn: next()?,
            proj: next()?,
            up: next()?,
            gate: if spec.gated_ffn && spec.moe.is_none() {
                Some(next()?)
            } else {
                None
            },
            row: [next()?, next()?, next()?, next()?],
            logits: None,
            stage: None,
            residual: false,
        })
    }

    /// View the step buffers as `rows` rows (at most their capacity): a partitioned call's
    /// last, shorter group.
    pub(super) fn narrow(&mut self, b: &B, rows: usize) -> Result<()> {
        let mut bufs = vec![
            &mut self.x,
            &mut self.h,
            &mut self.q,
            &mut self.k,
            &mut self.v,
        ];
        bufs.extend([&mut self.attn, &mut self.proj, &mut self.up]);
        if let Some(g) = self.gate.as_mut() {
            bufs.push(g);
        }
        for t in bufs {
            let (_, cols) = b.shape(t);
            b.reshape(t, rows, cols)?;
        }
        self.n = rows;
        Ok(())
    }
}

impl<B: Backend> LogitBuffers<B> {
    /// Fresh logits buffers of `rows` rows on `be` (the shapes [`logit_shapes`] gives `spec`).
    pub(super) fn new(be: &B, spec: &ModelSpec, rows: usize) -> Result<Self> {
        let [a, b, c] = logit_shapes(spec, rows);
        Ok(LogitBuffers {
            rows,
            last: be.alloc(a.0, a.1)?,
            normed: be.alloc(b.0, b.1)?,
            logits: be.alloc(c.0, c.1)?,
        })
    }

    /// View the logits buffers as `rows` rows (at most those they hold).
    pub(super) fn view(&mut self, b: &B, spec: &ModelSpec, rows: usize) -> Result<()> {
        let d = spec.d_model;
        b.reshape(&mut self.last, rows, d)?;
        b.reshape(&mut self.normed, rows, d)?;
        b.reshape(&mut self.logits, rows, spec.vocab_size)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::CpuBackend;
    use crate::engine::testing::Tiny;

    #[test]
    fn narrowing_views_every_step_buffer_as_fewer_rows_and_back() {
        let tiny = Tiny::new();
        let (b, spec) = (CpuBackend::new(1).unwrap(), &tiny.model.spec);
        let mut sc = Scratch::new(&b, spec, 8, false).unwrap();
        let cols = |sc: &Scratch<CpuBackend>| -> Vec<(usize, usize)> {
            let mut t = vec![
                &sc.x, &sc.h, &sc.q, &sc.k, &sc.v, &sc.attn, &sc.proj, &sc.up,
            ];
            t.extend(sc.gate.as_ref());
            t.into_iter().map(|t| b.shape(t)).collect()
        };
        let full = cols(&sc);
        assert!(sc.gate.is_some(), "the tiny model's FFN is gated");
        assert!(full.iter().all(|&(rows, _)| rows == 8), "{full:?}");
        sc.narrow(&b, 3).unwrap();
        assert_eq!((sc.n, sc.cap), (3, 8));
        let narrow = cols(&sc);
        for (f, n) in full.iter().zip(&narrow) {
            assert_eq!(*n, (3, f.1));
        }
        sc.narrow(&b, 8).unwrap();
        assert_eq!((sc.n, cols(&sc)), (8, full));
    }

    #[test]
    fn logits_buffers_are_viewed_as_fewer_rows_and_back() {
        let tiny = Tiny::new();
        let (b, spec) = (CpuBackend::new(1).unwrap(), &tiny.model.spec);
        let mut lb = LogitBuffers::new(&b, spec, 4).unwrap();
        let shapes = |lb: &LogitBuffers<CpuBackend>| {
            [b.shape(&lb.last), b.shape(&lb.normed), b.shape(&lb.logits)]
        };
        let (d, vocab) = (spec.d_model, spec.vocab_size);
        assert_eq!(shapes(&lb), [(4, d), (4, d), (4, vocab)]);
        lb.view(&b, spec, 1).unwrap();
        assert_eq!(shapes(&lb), [(1, d), (1, d), (1, vocab)]);
        lb.view(&b, spec, 4).unwrap();
        assert_eq!((lb.rows, shapes(&lb)), (4, [(4, d), (4, d), (4, vocab)]));
    }
}
