//! The FFN of a hybrid layer (PowerInfer): the hot neurons on the device, the cold ones on the CPU
//! from DRAM, merged on the device; one host wait per layer (two for the split, whose CPU sum
//! continues the device's).

use super::ffn::DeviceNeurons;
use super::ports::{ColdMerge, ColdView, FfnView};
use super::scratch::Scratch;
use super::trace::{self, Phase};
use super::{Engine, EngineError, Result};
use crate::backend::{Backend, HostStage, Landing};

impl<B: Backend> Engine<B> {
    /// `proj = FFN(h)` of a hybrid layer `layer`: the hot neurons on the device and the cold ones
    /// on the CPU, merged on the device; the FFN input lands in the scratch's host stage.
    pub(super) fn hybrid_ffn(
        &self,
        layer: usize,
        f: &FfnView<B>,
        cold: &mut ColdView<B>,
        sc: &mut Scratch<B>,
    ) -> Result<()> {
        let threshold = self.thresholds.get(layer).copied().unwrap_or(0.0);
        if self.tap.is_some() {
            return Err(EngineError::Weights(
                "activations are observed on a model loaded whole, not in hybrid execution".into(),
            ));
        }
        let mut stage = self.take_stage(sc)?;
        let done = self.hybrid_graph(layer, f, threshold, cold, &mut stage, sc);
        sc.stage = Some(stage);
        done
    }

    /// One layer's hybrid FFN as its graph of device ops, CPU ops and copies, issued in this
    /// order, with one host wait:
    /// 1. copy device→host: the FFN input, queued behind the attention (event `input`);
    /// 2. device: the hot neurons, queued at once where no predictor decides them;
    /// 3. host: wait for `input` (a blocking event, never a spin); the predictor, if any;
    /// 4. device: the hot neurons, queued here where the predictor decides them;
    /// 5. CPU: the cold neurons' activations, while the device runs 2 or 4;
    /// 6. merging, as the view's [`ColdMerge`] says: hybrid's CPU sums its down products from
    ///    zero, copies the partial sum host→device (staged by the driver; the host does not
    ///    wait) and the device adds it, `proj += partial`, after 2/4 in stream order; the
    ///    split's CPU waits for the device's sum (copied device→host behind 2/4), adds its
    ///    terms after the device's and copies the sum back in place of the device's.
    fn hybrid_graph(
        &self,
        layer: usize,
        f: &FfnView<B>,
        threshold: f32,
        cold: &mut ColdView<B>,
        stage: &mut HostStage,
        sc: &mut Scratch<B>,
    ) -> Result<()> {
        let b = &self.backend;
        let (n, d) = b.shape(&sc.h);
        let landing = trace::span(Phase::Landing);
        let input = Landing::start(b, &sc.h, stage)?;
        drop(landing);
        let early = self.predictor.is_none();
        if early {
            let _s = trace::span(Phase::DeviceNeurons);
            self.queue_hot(layer, f, threshold, None, cold.hot, sc)?;
        }
        let wait = trace::span(Phase::HostWait);
        let x = input.wait()?;
        drop(wait);
        let decide = trace::span(Phase::Decide);
        let keep = self.predict(layer, x, n)?;
        drop(decide);
        if !early {
            let _s = trace::span(Phase::DeviceNeurons);
            self.queue_hot(layer, f, threshold, keep.as_deref(), cold.hot, sc)?;
        }
        let keep = keep.as_deref();
        match &mut cold.merge {
            ColdMerge::Add(partial) => {
                let mut part = vec![0f32; n * d];
                {
                    let _s = trace::span(Phase::CpuNeurons);
                    cold.neurons
                        .activate_down(x, n, threshold, keep, &mut part)?;
                }
                b.reshape(partial, n, d)?;
                {
                    let _s = trace::span(Phase::H2d);
                    b.write(partial, &part)?;
                }
                let _s = trace::span(Phase::Merge);
                b.add(&mut sc.proj, partial)?;
            }
            ColdMerge::Continue => {
                let active = {
                    let _s = trace::span(Phase::CpuNeurons);
                    cold.neurons.activate(x, n, threshold, keep)?
                };
                let landing = trace::span(Phase::Landing);
                let device_sum = Landing::start(b, &sc.proj, stage)?;
                drop(landing);
                let mut sum = {
                    let _s = trace::span(Phase::HostWait);
                    device_sum.wait()?.to_vec()
                };
                {
                    let _s = trace::span(Phase::CpuNeurons);
                    cold.neurons.add_down(&active, n, &mut sum)?;
                }
                let _s = trace::span(Phase::H2d);
                b.write(&mut sc.proj, &sum)?;
            }
        }
        Ok(())
    }

    /// Queue the hot neurons `hot` of a hybrid layer on the device (`proj` = their FFN
    /// output; the bias where there are none).
    fn queue_hot(
        &self,
        layer: usize,
        f: &FfnView<B>,
        threshold: f32,
        keep: Option<&[bool]>,
        hot: &[u32],
        sc: &mut Scratch<B>,
    ) -> Result<()> {
        let b = &self.backend;
        let n = sc.n;
        if hot.is_empty() {
            b.zero(&mut sc.proj)?;
            let bias = match f {
                FfnView::Matrices { down, .. } => down.bias,
                FfnView::Bundles { down_bias, .. } => *down_bias,
            };
            if let Some(bias) = bias {
                b.add_bias(&mut sc.proj, bias)?;
            }
            return Ok(());
        }
        // Hot matrices have `hot` rows (gate, up) and columns (down): the hidden buffers
        // narrow to match. Hot bundles fill the first `hot` columns as they are.
        let narrow = matches!(f, FfnView::Matrices { .. });
        let d_ff = self.spec.d_ff;
        if narrow {
            b.reshape(&mut sc.up, n, hot.len())?;
            if let Some(g) = &mut sc.gate {
                b.reshape(g, n, hot.len())?;
            }
        }
        let done = self.device_ffn(layer, f, threshold, DeviceNeurons::hot(hot, keep), sc);
        if narrow {
            b.reshape(&mut sc.up, n, d_ff)?;
            if let Some(g) = &mut sc.gate {
                b.reshape(g, n, d_ff)?;
            }
        }
        done
    }
}
