//! What the FFN's hidden activations are shown to and masked by: the activation tap, and the
//! predictor's flags (run on the FFN input on the host, applied as a mask). Decides nothing about
//! where the FFN runs.

use super::{Engine, EngineError, Result};
use crate::backend::Backend;

/// A predictor's flags for a step (`n × d_ff`) and, where asked for, its scores.
pub(super) struct Predicted {
    pub(super) keep: Vec<bool>,
    pub(super) scores: Option<Vec<f32>>,
}

impl<B: Backend> Engine<B> {
    /// The rows of a device tensor on the host.
    fn host_rows(&self, t: &B::Tensor) -> Result<(Vec<f32>, usize)> {
        let (n, cols) = self.backend.shape(t);
        let mut v = vec![0f32; n * cols];
        self.backend.read(t, &mut v)?;
        Ok((v, n))
    }

    /// Layer `layer`'s FFN input and activations before the mask, shown to the tap.
    pub(super) fn show_tap(
        &self,
        layer: usize,
        input: &B::Tensor,
        pre_act: &B::Tensor,
    ) -> Result<()> {
        let Some(tap) = &self.tap else {
            return Ok(());
        };
        let (x, _) = self.host_rows(input)?;
        let (mut v, n) = self.host_rows(pre_act)?;
        let f = crate::backend::cpu::ops::activation(self.act);
        v.iter_mut().for_each(|x| *x = f(*x));
        tap.observe(layer, &x, &v, n);
        Ok(())
    }

    /// The predictor's flags for layer `layer` and the FFN input `x` (`n × d_ff`), if any.
    pub(super) fn predict(&self, layer: usize, x: &[f32], n: usize) -> Result<Option<Vec<bool>>> {
        Ok(self.predict_scored(layer, x, n, false)?.map(|p| p.keep))
    }

    /// As [`Engine::predict`], with the predictor's scores where `scored`.
    pub(super) fn predict_scored(
        &self,
        layer: usize,
        x: &[f32],
        n: usize,
        scored: bool,
    ) -> Result<Option<Predicted>> {
        let Some(p) = &self.predictor else {
            return Ok(None);
        };
        super::trace::add_cpu_bytes(p.weight_bytes(layer));
        let (keep, scores) = if scored {
            let (k, s) = p.scored(layer, x, n);
            (k, Some(s))
        } else {
            (p.active(layer, x, n), None)
        };
        let want = n * self.spec.d_ff;
        if keep.len() != want || scores.as_ref().is_some_and(|s| s.len() != want) {
            return Err(EngineError::Weights(format!(
                "the predictor of layer {layer} gave {} flags for {n}×{} activations",
                keep.len(),
                self.spec.d_ff
            )));
        }
        Ok(Some(Predicted { keep, scores }))
    }

    /// Zero the hidden activations of the neurons `keep` leaves out. Column `j` of `hidden` is
    /// neuron `ids[j]` (columns past `ids` unused), or neuron `j` without `ids`. (The
    /// neuron-aware kernels skip them instead; this is the same result, for any backend.)
    pub(super) fn mask_hidden(
        &self,
        keep: &[bool],
        ids: Option<&[u32]>,
        hidden: &mut B::Tensor,
    ) -> Result<()> {
        let d_ff = self.spec.d_ff;
        let (mut h, n) = self.host_rows(hidden)?;
        let cols = h.len() / n.max(1);
        let used = ids.map_or(cols, |ids| ids.len().min(cols));
        for t in 0..n {
            for j in 0..used {
                let id = ids.map_or(j, |ids| ids[j] as usize);
                if !keep[t * d_ff + id] {
                    h[t * cols + j] = 0.0;
                }
            }
        }
        self.backend.write(hidden, &h)?;
        Ok(())
    }

    /// The predictor's mask for the FFN input `input` applied to `hidden` (dense layers).
    pub(super) fn apply_predictor(
        &self,
        layer: usize,
        input: &B::Tensor,
        hidden: &mut B::Tensor,
    ) -> Result<()> {
        if self.predictor.is_none() {
            return Ok(());
        }
        let (x, n) = self.host_rows(input)?;
        match self.predict(layer, &x, n)? {
            Some(keep) => self.mask_hidden(&keep, None, hidden),
            None => Ok(()),
        }
    }
}
