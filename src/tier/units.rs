//! The GPU-centric sparse FFN (M2Cache): every layer's attention, norms and biases resident and
//! the output head, as in hybrid execution; the FFN neurons in DRAM; per layer one cache unit of
//! bundle slots on the device, which the neuron-listed kernels compute on in place. Each step the
//! layer's active neurons are decided (the CPU reads each neuron's deciding vector from DRAM and
//! applies the mask, or the predictor lists them), the unit's slot map (the ATU,
//! [`super::unit::SlotMap`]) names the ones it lacks, and those are gathered into one host
//! buffer, sent in one copy and scattered into the slots they take.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use super::hybrid::{ColdLayer, CpuSide, Resident, resident_source};
use super::ledger::Ledger;
use super::unit::{Eviction, SlotMap};
use crate::backend::cpu::kernels::Kernels;
use crate::backend::{Act, Backend, BundleShape};
use crate::engine::{
    EngineError, FfnView, HeadView, LayerView, MatmulShapes, NeuronUnit, Result, WeightSource,
};
use crate::plan::{Part, Plan, part_segment_name};
use crate::store::{Encoding, Store};
use crate::tensor::DType;

fn weights_err(msg: impl Into<String>) -> EngineError {
    EngineError::Weights(msg.into())
}

/// What the units have moved, over all layers.
#[derive(Debug, Default)]
pub struct UnitTraffic {
    /// Active neurons the steps needed.
    pub needed: AtomicU64,
    /// Of them, brought in (not in the unit).
    pub loads: AtomicU64,
    /// Host→device bytes of those loads (bundles and, with an up bias, its values).
    pub bytes: AtomicU64,
}

impl UnitTraffic {
    /// `[needed, loads, bytes]`.
    pub fn snapshot(&self) -> [u64; 3] {
        [
            self.needed.load(Ordering::Relaxed),
            self.loads.load(Ordering::Relaxed),
            self.bytes.load(Ordering::Relaxed),
        ]
    }
}

/// One layer's unit and the DRAM copy of its neurons.
struct LayerUnit<B: Backend> {
    neurons: ColdLayer,
    map: SlotMap,
    /// `slots` bundles, one per slot.
    unit: B::Weight,
    /// The up bias of the neuron in each slot (two-part bundles with one).
    slot_bias: Option<B::Weight>,
}

/// Where misses go on their way into a unit: one host buffer, one device buffer of as many
/// bundles as the largest unit, shared by the layers.
struct Staging<B: Backend> {
    bundles: B::Weight,
    bias: Option<B::Weight>,
    host: Vec<u8>,
    host_bias: Vec<f32>,
}

pub struct UnitWeights<B: Backend> {
    resident: Resident<B>,
    layers: Vec<LayerUnit<B>>,
    staging: Staging<B>,
    bundle: BundleShape,
    traffic: Arc<UnitTraffic>,
}

impl<B: Backend> UnitWeights<B> {
    /// Load everything but the FFN to the device, each layer's neurons into DRAM, and an empty
    /// unit of `slots[l]` bundles per layer (f16, as stored). Stale neurons give way by
    /// `score[l]` (e.g. the profile's activation frequencies; all equal without). `plan` is the
    /// store's offload plan for the same budget (its staging size).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        b: &B,
        store: Arc<Store>,
        plan: &Plan,
        slots: &[usize],
        score: Option<&[Vec<f32>]>,
        ledger: Arc<Ledger>,
        kernels: &'static Kernels,
        act: Act,
    ) -> Result<Self> {
        let m = &store.manifest;
        if m.model_id != plan.model_id {
            return Err(weights_err("the plan was made for another model"));
        }
        let spec = m.spec.clone();
        let (n_layers, d, d_ff) = (spec.n_layers, spec.d_model, spec.d_ff);
        if !store.ffn_bundled() {
            return Err(weights_err(
                "cache units hold neuron bundles: this model's FFN is stored as matrices",
            ));
        }
        if slots.len() != n_layers || slots.iter().any(|&k| k == 0 || k > d_ff) {
            return Err(weights_err(format!(
                "cache units need 1..={d_ff} slots for each of the {n_layers} layers"
            )));
        }
        let bundle = BundleShape {
            parts: if spec.gated_ffn { 3 } else { 2 },
            d,
        };
        let enc = Encoding::Format(DType::F16);
        let traffic = Arc::new(super::hybrid::ColdTraffic::default());
        let act_fn = crate::backend::cpu::ops::activation(act);
        let mut layers = Vec::with_capacity(n_layers);
        let resident = Resident::load(b, &store, &ledger, plan.dram.staging, |l, _| {
            let k = slots[l];
            let neurons = ColdLayer::bundle_rows(
                &store,
                &ledger,
                l,
                0..d_ff,
                CpuSide {
                    kernels,
                    act: act_fn,
                    traffic: traffic.clone(),
                },
            )?;
            let seg = part_segment_name(l, Part::Ffn);
            let unit = b.alloc_bundles(&format!("{seg} unit"), enc, bundle, k)?;
            let slot_bias = if neurons.has_up_bias() {
                Some(b.alloc_weight(&format!("{seg} unit up bias"), DType::F32, k, 1)?)
            } else {
                None
            };
            let eviction = match score {
                Some(s) => Eviction::Frequency(
                    s.get(l)
                        .cloned()
                        .ok_or_else(|| weights_err("a score for every layer"))?,
                ),
                None => Eviction::Frequency(vec![0.0; d_ff]),
            };
            let map = SlotMap::new(d_ff, k, eviction).map_err(|e| weights_err(e.to_string()))?;
            layers.push(LayerUnit {
                neurons,
                map,
                unit,
                slot_bias,
            });
            Ok(())
        })?;
        let widest = slots.iter().copied().max().unwrap_or(1);
        let biased = layers.iter().any(|u| u.slot_bias.is_some());
        let staging = Staging {
            bundles: b.alloc_bundles("unit staging", enc, bundle, widest)?,
            bias: if biased {
                Some(b.alloc_weight("unit staging up bias", DType::F32, widest, 1)?)
            } else {
                None
            },
            host: Vec::new(),
            host_bias: Vec::new(),
        };
        Ok(UnitWeights {
            resident,
            layers,
            staging,
            bundle,
            traffic: Arc::new(UnitTraffic::default()),
        })
    }

    /// What the units have moved so far.
    pub fn traffic(&self) -> Arc<UnitTraffic> {
        self.traffic.clone()
    }
}

/// A layer's unit as the engine drives it for one step.
struct UnitStep<'a, B: Backend> {
    layer: &'a mut LayerUnit<B>,
    staging: &'a mut Staging<B>,
    traffic: &'a UnitTraffic,
}

impl<B: Backend> NeuronUnit<B> for UnitStep<'_, B> {
    fn active(
        &self,
        x: &[f32],
        n: usize,
        threshold: f32,
        keep: Option<&[bool]>,
    ) -> Result<Vec<u32>> {
        match keep {
            // The predictor names the set (M2Cache's path): nothing is read from DRAM to
            // decide, and the kernels still apply the mask.
            Some(keep) => {
                let d_ff = keep.len() / n.max(1);
                Ok((0..d_ff as u32)
                    .filter(|&j| (0..n).any(|t| keep[t * d_ff + j as usize]))
                    .collect())
            }
            None => self.layer.neurons.active_ids(x, n, threshold, None),
        }
    }

    fn slots(&self) -> usize {
        self.layer.map.slots()
    }

    fn bring(&mut self, b: &B, neurons: &[u32]) -> Result<Vec<u32>> {
        let loads = self
            .layer
            .map
            .update(neurons)
            .map_err(|e| weights_err(e.to_string()))?;
        self.traffic
            .needed
            .fetch_add(neurons.len() as u64, Ordering::Relaxed);
        if !loads.is_empty()
            && let Err(e) = self.load(b, &loads)
        {
            self.layer.map.forget(&loads);
            return Err(e);
        }
        self.layer
            .map
            .slots_of(neurons)
            .ok_or_else(|| weights_err("a neuron just brought in is not in the unit"))
    }

    fn unit(&self) -> (&B::Weight, Option<&B::Weight>) {
        (&self.layer.unit, self.layer.slot_bias.as_ref())
    }
}

impl<B: Backend> UnitStep<'_, B> {
    /// Copy `loads` into the unit: gathered into one host buffer, sent in one copy, scattered
    /// into their slots.
    fn load(&mut self, b: &B, loads: &[super::unit::Load]) -> Result<()> {
        {
            let st = &mut *self.staging;
            let ids: Vec<u32> = loads.iter().map(|l| l.neuron).collect();
            let slots: Vec<u32> = loads.iter().map(|l| l.slot).collect();
            self.layer
                .neurons
                .gather(&ids, &mut st.host, &mut st.host_bias)?;
            // The staging buffers are free once the compute queued so far (the last scatter
            // out of them) is done.
            let free = b.compute_done()?;
            b.copies_wait(&free)?;
            b.upload_into(&mut st.bundles, 0, &st.host)?;
            let mut bytes = st.host.len();
            if let (Some(sb), Some(_)) = (&mut st.bias, &self.layer.slot_bias) {
                let values: &[u8] = bytemuck::cast_slice(&st.host_bias);
                b.upload_into(sb, 0, values)?;
                bytes += values.len();
            }
            let landed = b.copies_done()?;
            b.compute_waits(&landed)?;
            b.scatter_rows(&st.bundles, &slots, &mut self.layer.unit)?;
            if let (Some(sb), Some(dst)) = (&st.bias, &mut self.layer.slot_bias) {
                b.scatter_rows(sb, &slots, dst)?;
            }
            // The host buffer is refilled by the next layer: the copy must have read it.
            b.host_waits(&landed)?;
            self.traffic
                .loads
                .fetch_add(loads.len() as u64, Ordering::Relaxed);
            self.traffic
                .bytes
                .fetch_add(bytes as u64, Ordering::Relaxed);
        }
        Ok(())
    }
}

impl<B: Backend> WeightSource<B> for UnitWeights<B> {
    resident_source!();

    fn layer(&mut self, _: &B, l: usize) -> Result<LayerView<'_, B>> {
        let UnitWeights {
            resident,
            layers,
            staging,
            bundle,
            traffic,
        } = self;
        let ffn = FfnView::Bundles {
            runs: Vec::new(),
            shape: *bundle,
            up_bias: None,
            down_bias: resident.small(l).down_bias.as_ref(),
        };
        let unit = Box::new(UnitStep {
            layer: &mut layers[l],
            staging,
            traffic,
        });
        Ok(resident.layer(l, ffn, None, Some(unit)))
    }
}
