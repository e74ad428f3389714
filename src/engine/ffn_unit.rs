//! The FFN of a layer with a cache unit (M2Cache): the neurons each step needs computed by the
//! neuron-listed kernels from the unit's device slots, or where they rest in host memory, or
//! brought into the slots first.

use super::ports::{FfnView, NeuronUnit};
use super::scratch::Scratch;
use super::trace::{self, Phase};
use super::{Engine, EngineError, Result};
use crate::backend::cpu::sparse::DOWN_BLOCK;
use crate::backend::{Backend, BundleShape, Landing};

impl<B: Backend> Engine<B> {
    /// The FFN of a layer with a cache unit. Where the device decides (oracle masks, one
    /// precision tier, neurons readable in place) every neuron is listed and nothing comes back
    /// to the host; otherwise the input lands on the host (the one wait), the unit decides the
    /// active neurons (or the predictor does), and the listed kernels compute them, each from
    /// its slot or where it rests in host memory, or, a unit that cannot read in place, after
    /// bringing them in as many as its slots hold at a time.
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
        // Oracle masks on one precision tier whose neurons rest in host memory for the device
        // to read: the device decides. Every neuron is listed, from its slot or where it
        // rests, and the kernels' mask stops an inactive one after its deciding part: no
        // landing, no decision on the host, no wait.
        let on_device = (0..3).find(|&t| unit.slots(t) > 0 && unit.in_place(t).is_some());
        if let Some(tier) = on_device.filter(|_| self.predictor.is_none() && !unit.mixed()) {
            let all: Vec<u32> = (0..self.spec.d_ff as u32).collect();
            let device = trace::span(Phase::DeviceNeurons);
            self.start_output(*down_bias, sc)?;
            self.held_neurons(unit, (tier, &all), (*shape, threshold), None, sc)?;
            drop(device);
            return Ok(());
        }
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
        self.start_output(*down_bias, sc)?;
        for (tier, set) in tiers.iter().enumerate() {
            let keep = set.keep.as_deref().filter(|_| n > 1);
            let slots = unit.slots(tier).max(1);
            if unit.in_place(tier).is_some() {
                self.held_neurons(unit, (tier, &set.ids), (*shape, threshold), keep, sc)?;
                continue;
            }
            for chunk in rounds(&set.ids, slots) {
                let gather = trace::span(Phase::Gather);
                let at = unit.bring(b, tier, chunk)?;
                drop(gather);
                let (w, up_bias) = unit.unit(tier)?;
                self.listed_neurons((w, None, *shape, threshold), up_bias, &at, chunk, keep, sc)?;
            }
        }
        drop(device);
        Ok(())
    }

    /// The step's FFN output before any neuron is added: its down bias, or zero.
    fn start_output(&self, down_bias: Option<&B::Weight>, sc: &mut Scratch<B>) -> Result<()> {
        self.backend.zero(&mut sc.proj)?;
        if let Some(bias) = down_bias {
            self.backend.add_bias(&mut sc.proj, bias)?;
        }
        Ok(())
    }

    /// Neurons `ids` of tier `tier` computed, each from its slot in the unit or where it rests
    /// in host memory, in one list in their order: each token's sum is the one the whole FFN
    /// adds (their ids place each term in the one order of [`DOWN_BLOCK`]s). `keep`: which tokens need each (a step of several computes the union).
    /// One call for the whole list (the list's workspace holds a layer's neurons): calls of
    /// `slots` neurons each made SmolLM2 at 48M eleven a layer, each a fork and join of the
    /// threads with its in-place reads paced on their own, for the same sums.
    fn held_neurons(
        &self,
        unit: &mut dyn NeuronUnit<B>,
        (tier, ids): (usize, &[u32]),
        (shape, threshold): (BundleShape, f32),
        keep: Option<&[bool]>,
        sc: &mut Scratch<B>,
    ) -> Result<()> {
        let gather = trace::span(Phase::Gather);
        let entries = unit.hold(&self.backend, tier, ids)?;
        drop(gather);
        let (w, _) = unit.unit(tier)?;
        let rest = unit.in_place(tier);
        self.listed_neurons((w, rest, shape, threshold), None, &entries, ids, keep, sc)
    }

    /// Neurons `ids` of the step computed from rows `at` of `w` (slots, or neuron ids where
    /// they rest) and added to the step's FFN output; `keep`: which tokens need each (a step
    /// of several tokens computes the union).
    fn listed_neurons(
        &self,
        (w, rest, shape, threshold): (&B::Weight, Option<&B::Weight>, BundleShape, f32),
        up_bias: Option<&B::Weight>,
        at: &[u32],
        ids: &[u32],
        keep: Option<&[bool]>,
        sc: &mut Scratch<B>,
    ) -> Result<()> {
        let b = &self.backend;
        let listed = (w, rest);
        let Some(keep) = keep else {
            // Nothing between the two sides: one op, which may read each neuron once.
            let how = (self.act, threshold);
            let (h, out) = (&mut sc.up, &mut sc.proj);
            b.ffn_bundles_listed_from(listed, shape, &sc.h, how, up_bias, (at, ids), h, out)?;
            return Ok(());
        };
        b.ffn_bundles_up_listed_from(
            listed, shape, &sc.h, self.act, threshold, up_bias, at, &mut sc.up,
        )?;
        // A neuron one token needs (in this precision) may be off for another.
        self.mask_hidden(keep, Some(ids), &mut sc.up)?;
        b.ffn_bundles_down_listed_from(listed, shape, &sc.up, (at, ids), &mut sc.proj)?;
        Ok(())
    }
}

/// `ids` (ascending) cut into rounds of at most `slots` neurons, each cut on a
/// [`DOWN_BLOCK`] boundary where a block fits the slots: the rounds' down sums then add up to
/// what one call over the whole list sums, in the one order (a block larger than the slots is
/// cut where they end, and its sum is then two).
fn rounds(ids: &[u32], slots: usize) -> Vec<&[u32]> {
    let slots = slots.max(1);
    let mut out = Vec::new();
    let mut rest = ids;
    while !rest.is_empty() {
        let mut end = rest.len().min(slots);
        if end < rest.len() {
            // Back to the start of the block the cut would fall in, unless that empties the round.
            let block = rest[end] / DOWN_BLOCK;
            let start = rest[..end].partition_point(|&i| i / DOWN_BLOCK < block);
            if start > 0 {
                end = start;
            }
        }
        let (round, next) = rest.split_at(end);
        out.push(round);
        rest = next;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rounds cut on block boundaries where a block fits, cover the list in order, and never
    /// exceed the slots.
    #[test]
    fn rounds_cut_on_block_boundaries() {
        let b = DOWN_BLOCK;
        // Blocks of 40, 30 and 50 listed neurons.
        let ids: Vec<u32> = (0..40).chain(b..b + 30).chain(3 * b..3 * b + 50).collect();
        let cuts = |slots| {
            rounds(&ids, slots)
                .iter()
                .map(|r| r.len())
                .collect::<Vec<_>>()
        };
        assert_eq!(cuts(1000), vec![120]);
        assert_eq!(cuts(80), vec![70, 50]);
        assert_eq!(cuts(60), vec![40, 30, 50]);
        // A block larger than the slots is cut where they end.
        assert_eq!(cuts(35), vec![35, 35, 35, 15]);
        for slots in [1, 7, 35, 64, 1000] {
            let rs = rounds(&ids, slots);
            assert!(rs.iter().all(|r| !r.is_empty() && r.len() <= slots));
            assert_eq!(rs.concat(), ids);
        }
        assert!(rounds(&[], 8).is_empty());
    }
}
