//! The FFN of a layer with a cache unit (M2Cache): the neurons each step needs brought into the
//! unit's device slots and computed there by the neuron-listed kernels.

use super::ports::{FfnView, NeuronUnit};
use super::scratch::Scratch;
use super::trace::{self, Phase};
use super::{Engine, EngineError, Result};
use crate::backend::{Backend, Landing};

impl<B: Backend> Engine<B> {
    /// The FFN of a layer with a cache unit: the input lands on the host (the one wait), the
    /// unit decides the active neurons (or the predictor does) and brings them in, as many as
    /// its slots hold at a time, and the listed kernels compute them from their slots.
    pub(super) fn unit_ffn(
        &self,
        layer: usize,
        f: &FfnView<B>,
        unit: &mut dyn NeuronUnit<B>,
        sc: &mut Scratch<B>,
    ) -> Result<()> {
        let b = &self.backend;
        let FfnView::Bundles {
            shape, down_bias, ..
        } = f
        else {
            return Err(EngineError::Weights(
                "cache units hold neuron bundles: this FFN is stored as matrices".into(),
            ));
        };
        if self.tap.is_some() {
            return Err(EngineError::Weights(
                "activations are observed on a model loaded whole, not from cache units".into(),
            ));
        }
        let threshold = self.thresholds.get(layer).copied().unwrap_or(0.0);
        let n = sc.n;
        let mut stage = self.take_stage(sc)?;
        let decided = (|| {
            let landing = trace::span(Phase::Landing);
            let input = Landing::start(b, &sc.h, &mut stage)?;
            drop(landing);
            let wait = trace::span(Phase::HostWait);
            let x = input.wait()?;
            drop(wait);
            let _s = trace::span(Phase::Decide);
            let predicted = self.predict_scored(layer, x, n, unit.mixed())?;
            let (keep, scores) = match &predicted {
                Some(p) => (Some(p.keep.as_slice()), p.scores.as_deref()),
                None => (None, None),
            };
            unit.active(x, n, threshold, keep, scores)
        })();
        sc.stage = Some(stage);
        let tiers = decided?;
        let device = trace::span(Phase::DeviceNeurons);
        b.zero(&mut sc.proj)?;
        if let Some(bias) = down_bias {
            b.add_bias(&mut sc.proj, bias)?;
        }
        for (tier, set) in tiers.iter().enumerate() {
            let slots = unit.slots(tier).max(1);
            for chunk in set.ids.chunks(slots) {
                let gather = trace::span(Phase::Gather);
                let at = unit.bring(b, tier, chunk)?;
                drop(gather);
                let (w, up_bias) = unit.unit(tier)?;
                b.ffn_bundles_up_listed(
                    w, *shape, &sc.h, self.act, threshold, up_bias, &at, &mut sc.up,
                )?;
                if let Some(keep) = &set.keep
                    && n > 1
                {
                    // A neuron one token needs (in this precision) may be off for another.
                    self.mask_hidden(keep, Some(chunk), &mut sc.up)?;
                }
                b.ffn_bundles_down_listed(w, *shape, &sc.up, &at, &mut sc.proj)?;
            }
        }
        drop(device);
        Ok(())
    }
}
