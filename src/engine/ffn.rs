//! A layer's FFN: where it runs (on the device, split with the CPU, through a cache unit) and
//! the device's part of it, for whichever of the layer's neurons the device computes. The
//! hybrid and the cache-unit paths are `ffn_hybrid`'s and `ffn_unit`'s.

use super::ports::{ColdView, FfnView, NeuronUnit};
use super::scratch::Scratch;
use super::trace::{self, Phase};
use super::{Engine, EngineError, Result};
use crate::backend::{Backend, HostStage, ProductInput};

/// Where a layer's FFN runs, as its view says: all on the device, split between the device's hot
/// neurons and the CPU's cold ones (hybrid execution), or through a cache unit the neurons each
/// step needs are brought into.
pub(super) enum FfnSite<'l, 'a, B: Backend> {
    Device,
    Hybrid(&'l mut ColdView<'a, B>),
    Unit(&'l mut (dyn NeuronUnit<B> + 'a)),
}

impl<'l, 'a, B: Backend> FfnSite<'l, 'a, B> {
    /// The site of a layer whose view has these `cold` and `unit` parts: a cache unit, where
    /// the layer has one, computes the whole FFN.
    pub(super) fn of(
        cold: &'l mut Option<ColdView<'a, B>>,
        unit: &'l mut Option<Box<dyn NeuronUnit<B> + 'a>>,
    ) -> Self {
        match (unit.as_deref_mut(), cold.as_mut()) {
            (Some(unit), _) => FfnSite::Unit(unit),
            (None, Some(cold)) => FfnSite::Hybrid(cold),
            (None, None) => FfnSite::Device,
        }
    }
}

/// Which of a layer's neurons the device's FFN computes, and what masks them.
#[derive(Clone, Copy)]
pub(super) enum DeviceNeurons<'a> {
    /// All of them (the device holds the whole FFN): the predictor, if any, runs here on the
    /// layer's FFN input and masks them.
    All,
    /// The hot neurons of a hybrid layer (the device FFN's hidden columns), with no predictor:
    /// the threshold's mask alone decides.
    Hot,
    /// The hot neurons of a hybrid layer, `ids` in the order of the device FFN's hidden
    /// columns, of which the predictor's flags `keep` (`n × d_ff` by neuron id, already computed
    /// on the host) pick each token's.
    HotPredicted { ids: &'a [u32], keep: &'a [bool] },
}

impl<'a> DeviceNeurons<'a> {
    /// The hot neurons `ids` of a hybrid layer, with the predictor's flags where it has run.
    pub(super) fn hot(ids: &'a [u32], keep: Option<&'a [bool]>) -> Self {
        match keep {
            Some(keep) => DeviceNeurons::HotPredicted { ids, keep },
            None => DeviceNeurons::Hot,
        }
    }
}

impl<B: Backend> Engine<B> {
    /// `proj = FFN(h)` of layer `layer`, using `sc.up` / `sc.gate` for the hidden activations,
    /// where `site` says: on the device; in hybrid execution the hot neurons on the device and
    /// the cold ones on the CPU, merged on the device; or from a cache unit.
    pub(super) fn ffn(
        &self,
        layer: usize,
        f: &FfnView<B>,
        site: FfnSite<'_, '_, B>,
        sc: &mut Scratch<B>,
    ) -> Result<()> {
        match site {
            FfnSite::Device => {
                let _s = trace::span(Phase::DeviceNeurons);
                let threshold = self.thresholds.get(layer).copied().unwrap_or(0.0);
                self.device_ffn(layer, f, threshold, DeviceNeurons::All, sc)
            }
            FfnSite::Hybrid(cold) => self.hybrid_ffn(layer, f, cold, sc),
            FfnSite::Unit(unit) => self.unit_ffn(layer, f, unit, sc),
        }
    }

    /// The gate, up and down weights of an FFN that one [`Backend::gate_up_down`] computes: a
    /// gated FFN of whole matrices without bias, whose activations nothing observes (the tap)
    /// or masks (`masked`, or the predictor).
    pub(super) fn whole_gated_ffn<'v>(
        &self,
        f: &FfnView<'v, B>,
        masked: bool,
    ) -> Option<(&'v B::Weight, &'v B::Weight, &'v B::Weight)> {
        if masked || self.tap.is_some() || self.predictor.is_some() {
            return None;
        }
        let FfnView::Matrices {
            gate: Some(gate),
            up,
            down,
        } = f
        else {
            return None;
        };
        if gate.bias.is_some() || up.bias.is_some() || down.bias.is_some() {
            return None;
        }
        match (
            gate.blocks.as_slice(),
            up.blocks.as_slice(),
            down.blocks.as_slice(),
        ) {
            ([(0, g)], [(0, u)], [(0, d)]) => Some((*g, *u, *d)),
            _ => None,
        }
    }

    /// The host stage the step's FFN input lands in, taken out of the scratch (made at the
    /// first use, or larger when the step is): it stays out while the copy into it is in flight
    /// (the device ops borrow the rest) and the caller puts it back whatever happens.
    pub(super) fn take_stage(&self, sc: &mut Scratch<B>) -> Result<HostStage> {
        let values = sc.n * self.spec.d_model;
        match sc.stage.take() {
            Some(s) if s.len() >= values => Ok(s),
            _ => Ok(HostStage::new(&self.backend, values)?),
        }
    }

    /// The FFN on the device, over the neurons `neurons` says.
    pub(super) fn device_ffn(
        &self,
        layer: usize,
        f: &FfnView<B>,
        threshold: f32,
        neurons: DeviceNeurons<'_>,
        sc: &mut Scratch<B>,
    ) -> Result<()> {
        match neurons {
            DeviceNeurons::All => {
                let mask = |input: &B::Tensor, hidden: &mut B::Tensor| {
                    self.apply_predictor(layer, input, hidden)
                };
                self.ffn_products(layer, f, threshold, false, mask, sc)
            }
            DeviceNeurons::Hot => self.ffn_products(layer, f, threshold, true, |_, _| Ok(()), sc),
            DeviceNeurons::HotPredicted { ids, keep } => {
                self.predicted_hot_ffn(layer, f, threshold, ids, keep, sc)
            }
        }
    }

    /// The hot neurons `ids` of a hybrid layer of which the predictor's flags `keep` pick: over
    /// a hot block of bundles, only the hot neurons some token needs are read (the
    /// neuron-listed kernels), their activations compact in `sc.up`; else all of them, masked.
    fn predicted_hot_ffn(
        &self,
        layer: usize,
        f: &FfnView<B>,
        threshold: f32,
        ids: &[u32],
        keep: &[bool],
        sc: &mut Scratch<B>,
    ) -> Result<()> {
        let b = &self.backend;
        if let FfnView::Bundles {
            runs,
            shape,
            up_bias,
            down_bias,
        } = f
            && let [(0, run)] = runs.as_slice()
        {
            let d_ff = self.spec.d_ff;
            let (n, _) = b.shape(&sc.h);
            let listed: Vec<u32> = (0..ids.len() as u32)
                .filter(|&j| (0..n).any(|t| keep[t * d_ff + ids[j as usize] as usize]))
                .collect();
            b.ffn_bundles_up_listed(
                run, *shape, &sc.h, self.act, threshold, *up_bias, &listed, &mut sc.up,
            )?;
            let listed_ids: Vec<u32> = listed.iter().map(|&j| ids[j as usize]).collect();
            if n > 1 {
                // A neuron listed for one token may be off for another.
                self.mask_hidden(keep, Some(&listed_ids), &mut sc.up)?;
            }
            b.zero(&mut sc.proj)?;
            let down = (listed.as_slice(), listed_ids.as_slice());
            b.ffn_bundles_down_listed(run, *shape, &sc.up, down, &mut sc.proj)?;
            if let Some(bias) = down_bias {
                b.add_bias(&mut sc.proj, bias)?;
            }
            return Ok(());
        }
        let mask =
            |_: &B::Tensor, hidden: &mut B::Tensor| self.mask_hidden(keep, Some(ids), hidden);
        self.ffn_products(layer, f, threshold, true, mask, sc)
    }

    /// The FFN's products on the device over the neurons `f` holds, `mask` applied to their
    /// hidden activations (given the FFN input); `masked`: some mask beyond the threshold may
    /// apply (a hybrid layer's), so the gated product is not fused into the FFN's output.
    fn ffn_products(
        &self,
        layer: usize,
        f: &FfnView<B>,
        threshold: f32,
        masked: bool,
        mask: impl Fn(&B::Tensor, &mut B::Tensor) -> Result<()>,
        sc: &mut Scratch<B>,
    ) -> Result<()> {
        let b = &self.backend;
        match f {
            FfnView::Matrices { gate, up, down } => {
                let hidden = match (gate, &mut sc.gate) {
                    (Some(wg), Some(g)) => {
                        // Nothing but the tap reads the products before their gating: one op
                        // for the two products and the gated one (one kernel on CUDA).
                        let how = (self.act, threshold);
                        // Nor, unmasked, does anything but down read the gated product: one op
                        // to the FFN's output.
                        if let Some(ws) = self.whole_gated_ffn(f, masked) {
                            let input = ProductInput::Rows(&sc.h);
                            b.gate_up_down(input, ws, how, (g, &mut sc.up), &mut sc.proj)?;
                            return Ok(());
                        }
                        match (&self.tap, wg.blocks.as_slice(), up.blocks.as_slice()) {
                            (None, [(0, w_gate)], [(0, w_up)])
                                if wg.bias.is_none() && up.bias.is_none() =>
                            {
                                b.gate_up(&sc.h, (w_gate, w_up), how, g, &mut sc.up)?;
                            }
                            _ => {
                                let input = ProductInput::Rows(&sc.h);
                                self.linears(&[up, wg], input, &mut [&mut sc.up, g])?;
                                self.show_tap(layer, &sc.h, g)?;
                                b.gated(g, &sc.up, self.act, threshold)?;
                            }
                        }
                        mask(&sc.h, g)?;
                        &*g
                    }
                    _ => {
                        self.linear(up, &sc.h, &mut sc.up)?;
                        self.show_tap(layer, &sc.h, &sc.up)?;
                        b.activate(&mut sc.up, self.act, threshold)?;
                        mask(&sc.h, &mut sc.up)?;
                        &sc.up
                    }
                };
                self.linear(down, hidden, &mut sc.proj)?;
            }
            FfnView::Bundles {
                runs,
                shape,
                up_bias,
                down_bias,
            } => {
                if self.tap.is_some() {
                    return Err(EngineError::Weights(
                        "activations are observed on the FFN matrices: profile a model loaded whole, not an offload store's neuron bundles".into(),
                    ));
                }
                for &(first, run) in runs {
                    b.ffn_bundles_up(
                        run, *shape, &sc.h, self.act, threshold, *up_bias, &mut sc.up, first,
                    )?;
                }
                mask(&sc.h, &mut sc.up)?;
                b.zero(&mut sc.proj)?;
                for &(first, run) in runs {
                    b.ffn_bundles_down(run, *shape, &sc.up, first, &mut sc.proj)?;
                }
                if let Some(bias) = down_bias {
                    b.add_bias(&mut sc.proj, bias)?;
                }
            }
        }
        Ok(())
    }
}
