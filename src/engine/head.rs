//! The head of a step: the final norm and the output matrix over the rows whose logits come back,
//! into logits buffers held from the step's start, and those logits read to the host.

use super::ports::WeightSource;
use super::scratch::{LogitBuffers, Scratch};
use super::{Engine, EngineError, NonFiniteAt, Result};
use crate::backend::Backend;

impl<B: Backend> Engine<B> {
    /// Fresh logits buffers for `rows` rows, and at least for the rows the plan holds
    /// ([`Engine::with_logit_rows`], at most a step's).
    fn logit_buffers(&self, rows: usize) -> Result<LogitBuffers<B>> {
        let rows = rows.max(self.logit_rows.min(self.prefill.group));
        LogitBuffers::new(&self.backend, &self.spec, rows)
    }

    /// Hold the logits buffers of a call returning up to `rows` rows at a time from its start,
    /// so a step holds all its memory while its layers run.
    pub(super) fn hold_logits(&self, sc: &mut Scratch<B>, rows: usize) -> Result<()> {
        match sc.logits.take() {
            // Held buffers serve any call returning as many rows or fewer (the plan counts
            // them).
            Some(lb) if lb.rows >= rows => sc.logits = Some(lb),
            old => {
                drop(old);
                if rows > 0 {
                    sc.logits = Some(self.logit_buffers(rows)?);
                }
            }
        }
        Ok(())
    }

    /// The head over the last `rows` rows of `x` (`n` rows; at most the held logits rows):
    /// their logits on the host.
    pub(super) fn head_rows(
        &self,
        source: &mut dyn WeightSource<B>,
        sc: &mut Scratch<B>,
        rows: usize,
    ) -> Result<Vec<f32>> {
        let last: Vec<usize> = (sc.n - rows..sc.n).collect();
        self.head_of(source, sc, &last)
    }

    /// The head over rows `rows` of `x`, in that order: their logits on the host.
    pub(super) fn head_of(
        &self,
        source: &mut dyn WeightSource<B>,
        sc: &mut Scratch<B>,
        rows: &[usize],
    ) -> Result<Vec<f32>> {
        if !matches!(&sc.logits, Some(lb) if lb.rows >= rows.len()) {
            sc.logits = None;
            sc.logits = Some(self.logit_buffers(rows.len())?);
        }
        self.head_ops(source, sc, rows)?;
        self.head_read(sc, rows.len())
    }

    /// The head's ops over rows `rows` of `x`, into the held logits buffers (holding that
    /// many rows), which are left viewed as their full size.
    pub(super) fn head_ops(
        &self,
        source: &mut dyn WeightSource<B>,
        sc: &mut Scratch<B>,
        rows: &[usize],
    ) -> Result<()> {
        let b = &self.backend;
        let m = rows.len();
        let mut lb = match sc.logits.take() {
            Some(lb) if lb.rows >= m => lb,
            _ => {
                return Err(EngineError::Weights(format!(
                    "the head over {m} rows without logits buffers for them"
                )));
            }
        };
        lb.view(b, &self.spec, m)?;
        // Runs of consecutive rows, one copy each.
        let mut i = 0;
        while i < m {
            let mut j = i + 1;
            while j < m && rows[j] == rows[j - 1] + 1 {
                j += 1;
            }
            b.copy_rows(&sc.x, rows[i], &mut lb.last, i, j - i)?;
            i = j;
        }
        {
            let head = source.head(b)?;
            self.norm(&lb.last, &head.norm, &mut lb.normed)?;
            self.linear(&head.output, &lb.normed, &mut lb.logits)?;
        }
        source.head_done(b)?;
        let full = lb.rows;
        lb.view(b, &self.spec, full)?;
        sc.logits = Some(lb);
        Ok(())
    }

    /// The first `m` rows of the logits [`Engine::head_ops`] left, on the host.
    pub(super) fn head_read(&self, sc: &mut Scratch<B>, m: usize) -> Result<Vec<f32>> {
        let lb = sc
            .logits
            .as_mut()
            .ok_or_else(|| EngineError::Weights("logits read without their buffers".into()))?;
        lb.view(&self.backend, &self.spec, m)?;
        let mut host = vec![0f32; m * self.spec.vocab_size];
        let read = self.backend.read(&lb.logits, &mut host);
        let full = lb.rows;
        lb.view(&self.backend, &self.spec, full)?;
        read?;
        // Vocab values a row: cheap next to the head's matmul, and NaN would otherwise be
        // sampled from as if it were a distribution.
        if host.iter().any(|v| !v.is_finite()) {
            return Err(EngineError::NonFinite(NonFiniteAt::Logits));
        }
        Ok(host)
    }

    /// Whether every value of the hidden state `x` is finite (read back to the host: for
    /// locating a non-finite pass only).
    pub(super) fn all_finite(&self, x: &B::Tensor) -> Result<bool> {
        let (rows, d) = self.backend.shape(x);
        let mut host = vec![0f32; rows * d];
        self.backend.read(x, &mut host)?;
        Ok(host.iter().all(|v| v.is_finite()))
    }
}
