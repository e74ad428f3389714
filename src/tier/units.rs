//! The GPU-centric sparse FFN (M2Cache): every layer's attention, norms and biases resident and
//! the output head, as in hybrid execution; the FFN neurons in DRAM; per layer one cache unit of
//! bundle slots on the device, which the neuron-listed kernels compute on in place.
//!
//! Where a layer has no up bias, its neurons in DRAM are also mapped for the device to read in
//! place over the link ([`Backend::map_bundles`]): a step lists its neurons once, each from its
//! slot or where it rests, so a miss crosses the link once and is never gathered, copied or
//! scattered. Free slots fill with the most valued neurons (the profile's frequencies) and
//! nothing held is evicted: with misses read in place, bringing one in pays only if it comes
//! back before it gives way. With oracle masks on one precision tier the device decides: every
//! neuron is listed and the kernels' mask stops an inactive one after its deciding part (no
//! landing, no decision on the host). With a predictor or mixed precision the host decides and
//! only the set is listed.
//!
//! With an up bias (it goes by slot), each step's active neurons are decided on the host (the CPU
//! reads each neuron's deciding vector from DRAM and applies the mask, or the predictor lists
//! them), the unit's slot map (the ATU, [`super::atu::SlotMap`]) names the ones it lacks, and
//! those are gathered into one host buffer, sent in one copy and scattered into the slots they
//! take.
//!
//! With mixed precision ([`super::precision`]) a unit has one region per precision tier (f16,
//! INT8, INT4), each with its slot map and its DRAM copy of the neurons in that encoding (the
//! store's bundles); a neuron a token ranks in a tier is brought into that tier's region.
//!
//! Where every layer's attention does not fit beside the units, the streaming source holds the
//! same units (`UnitFfns`) beside attention resident by rows and streamed through its slots
//! ([`super::stream`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use super::atu::{Eviction, SlotMap};
use super::cold::{ColdLayer, ColdTraffic, CpuSide, copy_rows};
use super::hybrid::{HotFfn, layer_ffn};
use super::precision::split_by_precision;
use super::resident::{Resident, Small, resident_source};
use crate::backend::cpu::kernels::Kernels;
use crate::backend::{Act, Backend, BundleShape, HostStage, IN_REST};
use crate::engine::TierSet;
use crate::engine::trace::{Phase, span};
use crate::engine::{
    ColdMerge, ColdView, EngineError, FfnView, HeadView, LayerView, NeuronUnit, Result,
    WeightSource,
};
use crate::footprint::MatmulShapes;
use crate::footprint::ledger::Ledger;
use crate::footprint::ledger::{Reservation, Tier};
use crate::plan::precision::{Precision, TIER_ENCODINGS};
use crate::plan::units::HybridLayers;
use crate::plan::{Part, Plan, part_segment_name};
use crate::store::{Store, names};
use crate::tensor::{AlignedBuf, Bytes, DType};

fn weights_err(msg: impl Into<String>) -> EngineError {
    EngineError::Weights(msg.into())
}

/// What the units have moved, over all layers.
#[derive(Debug, Default)]
pub struct UnitTraffic {
    /// Active neurons the steps needed (a neuron needed in two tiers counts twice).
    pub needed: AtomicU64,
    /// Of them, brought in (not in the unit).
    pub loads: AtomicU64,
    /// Host→device bytes of those loads (bundles and, with an up bias, its values).
    pub bytes: AtomicU64,
    /// Loads by precision tier (f16, INT8, INT4).
    pub tier_loads: [AtomicU64; 3],
    /// Of the needed, listed where they rest in host memory (read in place over the link: the
    /// deciding part of each, the rest of those the mask leaves on).
    pub in_place: AtomicU64,
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

    /// Neurons listed where they rest in host memory.
    pub fn in_place(&self) -> u64 {
        self.in_place.load(Ordering::Relaxed)
    }

    /// Loads by precision tier.
    pub fn tier_loads(&self) -> [u64; 3] {
        [0, 1, 2].map(|i| self.tier_loads[i].load(Ordering::Relaxed))
    }
}

/// A layer's neurons in DRAM in one encoding (the store's bundles, row `j` = neuron `j`).
struct DramBundles {
    /// Every neuron's bundle, in a page-aligned buffer of its own (so it can be mapped).
    bytes: Bytes,
    row_bytes: usize,
    _hold: Reservation,
}

impl DramBundles {
    fn read(store: &Store, ledger: &Arc<Ledger>, l: usize, tier: usize) -> Result<Self> {
        let enc = TIER_ENCODINGS[tier];
        let s = store.require(&names::bundles(l, enc)).map_err(|e| {
            weights_err(format!(
                "{} neurons need the store's {} bundles (convert with --encodings int8,int4): {e}",
                enc.name(),
                enc.name()
            ))
        })?;
        let (_, extent) = s.read_extent(0..s.rows);
        let hold = ledger
            .reserve(
                Tier::Dram,
                extent,
                &format!("{} neurons of layer {l}", enc.name()),
            )
            .map_err(|e| weights_err(e.to_string()))?;
        let mut buf = AlignedBuf::zeroed(extent as usize);
        let (first, _) = store
            .read_rows_into(s, 0..s.rows, &mut buf)
            .map_err(|e| weights_err(e.to_string()))?;
        Ok(DramBundles {
            bytes: Bytes::Aligned {
                buf: Arc::new(buf),
                range: first..first + s.rows * s.row_bytes(),
            },
            row_bytes: s.row_bytes(),
            _hold: hold,
        })
    }

    /// The bundles of `ids` at the start of `out`; the bytes written.
    fn gather(&self, ids: &[u32], out: &mut [u8]) -> Result<usize> {
        let (rb, data) = (self.row_bytes, self.bytes.as_slice());
        if out.len() < ids.len() * rb {
            return Err(weights_err(
                "the staging buffer is smaller than the neurons",
            ));
        }
        let rows: Vec<usize> = ids.iter().map(|&id| id as usize).collect();
        if let Some(&r) = rows.iter().find(|&&r| (r + 1) * rb > data.len()) {
            return Err(weights_err(format!("neuron {r} is not held in DRAM")));
        }
        copy_rows(data, rb, &rows, out);
        Ok(ids.len() * rb)
    }
}

/// Host memory misses are gathered into for their one copy: a page-locked stage, counted in
/// DRAM.
struct HostStaging {
    stage: HostStage,
    _hold: Reservation,
}

impl HostStaging {
    fn new<B: Backend>(b: &B, ledger: &Arc<Ledger>, bytes: usize, what: &str) -> Result<Self> {
        // Whole f32s (the biases are read as f32), at least one.
        let values = bytes.div_ceil(4).max(1);
        let hold = ledger
            .reserve(Tier::Dram, values as u64 * 4, what)
            .map_err(|e| weights_err(e.to_string()))?;
        Ok(HostStaging {
            stage: HostStage::new(b, values)?,
            _hold: hold,
        })
    }
}

/// One precision tier's region of a layer's unit.
struct TierUnit<B: Backend> {
    /// The neurons in this tier's encoding (the f16 tier gathers from the layer's own copy).
    dram: Option<DramBundles>,
    map: SlotMap,
    /// One bundle per slot.
    unit: B::Weight,
    /// Every neuron of the layer in this tier's encoding where it rests in host memory, mapped
    /// for the device to read in place: the misses are computed there (none with an up bias,
    /// whose values go by slot).
    in_place: Option<B::Weight>,
    /// The up bias of the neuron in each slot (two-part bundles with one).
    slot_bias: Option<B::Weight>,
}

/// A layer's FFN: a cache unit, or (a mixed plan's hybrid layer) hot neurons resident with
/// the CPU computing the others. (One per layer, made once: their sizes do not matter.)
#[allow(clippy::large_enum_variant)]
enum LayerFfn<B: Backend> {
    Unit(LayerUnit<B>),
    Hybrid {
        hot: HotFfn<B>,
        hot_ids: Vec<u32>,
        cold: ColdLayer,
    },
}

/// One layer's unit and the DRAM copy of its neurons.
struct LayerUnit<B: Backend> {
    /// Every neuron in f16: what decides the active set (oracle masks), and the f16 tier's
    /// source.
    neurons: ColdLayer,
    tiers: [Option<TierUnit<B>>; 3],
}

type StagingTier<B> = (<B as Backend>::Weight, Option<<B as Backend>::Weight>);

/// Where misses go on their way into a unit: one host buffer, and per tier one device buffer
/// of as many bundles as that tier's largest region, shared by the layers.
struct Staging<B: Backend> {
    /// Per tier, the bundles and their up biases.
    tiers: [Option<StagingTier<B>>; 3],
    /// Room for the largest region's bundles, and their up biases (f32).
    host: HostStaging,
    host_bias: HostStaging,
}

pub struct UnitWeights<B: Backend> {
    resident: Resident<B>,
    ffns: UnitFfns<B>,
}

/// What a cache-unit source holds per layer: `slots[l][tier]` bundles in each tier's encoding
/// at `precision`, stale neurons giving way by `score[l]` (e.g. the profile's activation
/// frequencies; all equal without); the layers `hybrid` names run hybrid instead (no slots).
pub struct UnitLayout<'a> {
    pub slots: Vec<[usize; 3]>,
    pub precision: Precision,
    pub score: Option<&'a [Vec<f32>]>,
    pub hybrid: Option<&'a HybridLayers>,
}

impl<'a> UnitLayout<'a> {
    /// The layout of a cache-unit plan.
    pub fn of(plan: &'a crate::plan::units::UnitPlan) -> Self {
        UnitLayout {
            slots: plan.slots(),
            precision: plan.precision,
            score: Some(&plan.scores),
            hybrid: plan.hybrid.as_ref(),
        }
    }
}

/// Every layer's FFN of a cache-unit plan (its unit, or a mixed plan's hybrid layer), the
/// staging misses come in by and the merge buffer of hybrid layers: what [`UnitWeights`] holds
/// beside resident attention, and the streaming source beside streamed attention.
pub(super) struct UnitFfns<B: Backend> {
    layers: Vec<LayerFfn<B>>,
    staging: Staging<B>,
    /// The buffer hybrid layers' CPU sums come back into (where there are any).
    partial: Option<B::Tensor>,
    bundle: BundleShape,
    gated: bool,
    precision: Precision,
    traffic: Arc<UnitTraffic>,
}

/// Loads a [`UnitFfns`] layer by layer, each after its layer's norms and biases.
pub(super) struct UnitFfnsLoader<'a> {
    layout: &'a UnitLayout<'a>,
    bundle: BundleShape,
    d_ff: usize,
    gated: bool,
    kernels: &'static Kernels,
    act: fn(f32) -> f32,
    traffic: Arc<ColdTraffic>,
}

impl<'a> UnitFfnsLoader<'a> {
    /// Checks `layout` against `store` (bundles, slots in range).
    pub(super) fn new(
        store: &Store,
        layout: &'a UnitLayout<'a>,
        kernels: &'static Kernels,
        act: Act,
    ) -> Result<Self> {
        let spec = &store.manifest.spec;
        check_slots(store, &layout.slots, layout.precision, layout.hybrid)?;
        Ok(UnitFfnsLoader {
            layout,
            bundle: BundleShape {
                parts: if spec.gated_ffn { 3 } else { 2 },
                d: spec.d_model,
            },
            d_ff: spec.d_ff,
            gated: spec.gated_ffn,
            kernels,
            act: crate::backend::cpu::ops::activation(act),
            traffic: Arc::new(ColdTraffic::default()),
        })
    }

    fn shape(&self) -> UnitShape<'_> {
        UnitShape {
            slots: &self.layout.slots,
            precision: self.layout.precision,
            score: self.layout.score,
            bundle: self.bundle,
            d_ff: self.d_ff,
        }
    }

    /// Layer `l`'s FFN into `layers`: its empty unit (its neurons read into DRAM), or, hybrid,
    /// its hot neurons gathered onto the device (the device's up bias in `sm` rewritten in
    /// their order) and the others into DRAM for the CPU.
    fn layer<B: Backend>(
        &self,
        b: &B,
        store: &Store,
        ledger: &Arc<Ledger>,
        l: usize,
        sm: &mut Small<B>,
    ) -> Result<LayerFfn<B>> {
        let cpu = CpuSide {
            kernels: self.kernels,
            act: self.act,
            traffic: self.traffic.clone(),
        };
        let hybrid = self.layout.hybrid;
        if let (Some(ids), Some(h)) = (hot_of(hybrid, l), hybrid) {
            let (hot, cold) = layer_ffn(
                b,
                store,
                ledger,
                l,
                ids,
                h.cold_cost[l],
                &mut sm.up_bias,
                cpu,
            )?;
            return Ok(LayerFfn::Hybrid {
                hot,
                hot_ids: ids.clone(),
                cold,
            });
        }
        let unit = LayerUnit::load(b, store, ledger, l, &self.shape(), cpu)?;
        Ok(LayerFfn::Unit(unit))
    }

    /// Every layer's FFN loaded, each after `small[l]` (the layers' norms and biases).
    pub(super) fn load_all<B: Backend>(
        &self,
        b: &B,
        store: &Store,
        ledger: &Arc<Ledger>,
        small: &mut [Small<B>],
    ) -> Result<UnitFfns<B>> {
        let layers = small
            .iter_mut()
            .enumerate()
            .map(|(l, sm)| self.layer(b, store, ledger, l, sm))
            .collect::<Result<Vec<_>>>()?;
        self.finish(b, ledger, layers)
    }

    /// The FFNs of `layers` with the staging buffers and, where a layer runs hybrid, the merge
    /// buffer.
    fn finish<B: Backend>(
        &self,
        b: &B,
        ledger: &Arc<Ledger>,
        mut layers: Vec<LayerFfn<B>>,
    ) -> Result<UnitFfns<B>> {
        ColdLayer::pack_gathered(layers.iter_mut().filter_map(|u| match u {
            LayerFfn::Hybrid { cold, .. } => Some(cold),
            LayerFfn::Unit(_) => None,
        }));
        let hybrid = self.layout.hybrid;
        let biased = layers.iter().any(|u| match u {
            LayerFfn::Unit(u) => u.tiers.iter().flatten().any(|t| t.slot_bias.is_some()),
            LayerFfn::Hybrid { .. } => false,
        });
        let staging = Staging::alloc(b, ledger, &self.shape(), biased)?;
        let partial = match hybrid {
            Some(h) if (0..layers.len()).any(|l| hot_of(hybrid, l).is_some()) => {
                Some(b.alloc(h.batch.max(1), self.bundle.d)?)
            }
            _ => None,
        };
        Ok(UnitFfns {
            layers,
            staging,
            partial,
            bundle: self.bundle,
            gated: self.gated,
            precision: self.layout.precision,
            traffic: Arc::new(UnitTraffic::default()),
        })
    }
}

impl<B: Backend> UnitWeights<B> {
    /// Load everything but the FFN to the device, each layer's neurons into DRAM (f16, and the
    /// store's INT8/INT4 bundles where `precision` uses them), and an empty unit per layer of
    /// `slots[l][tier]` bundles in each tier's encoding. Stale neurons give way by `score[l]`
    /// (e.g. the profile's activation frequencies; all equal without). `plan` is the store's
    /// offload plan for the same budget (its staging size). The layers `hybrid` names run
    /// hybrid instead: its hot neurons resident, the CPU computing the others (no unit; their
    /// slots are none).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        b: &B,
        store: Arc<Store>,
        plan: &Plan,
        slots: &[[usize; 3]],
        precision: Precision,
        score: Option<&[Vec<f32>]>,
        hybrid: Option<&HybridLayers>,
        ledger: Arc<Ledger>,
        kernels: &'static Kernels,
        act: Act,
    ) -> Result<Self> {
        let m = &store.manifest;
        if m.model_id != plan.model_id {
            return Err(weights_err("the plan was made for another model"));
        }
        let layout = UnitLayout {
            slots: slots.to_vec(),
            precision,
            score,
            hybrid,
        };
        let loader = UnitFfnsLoader::new(&store, &layout, kernels, act)?;
        let mut layers = Vec::with_capacity(m.spec.n_layers);
        let resident = Resident::load(b, &store, &ledger, plan.dram.staging, |l, sm, _| {
            layers.push(loader.layer(b, &store, &ledger, l, sm)?);
            Ok(())
        })?;
        let ffns = loader.finish(b, &ledger, layers)?;
        Ok(UnitWeights { resident, ffns })
    }

    /// What the units have moved so far.
    pub fn traffic(&self) -> Arc<UnitTraffic> {
        self.ffns.traffic()
    }
}

/// Layer `l`'s FFN as a layer view takes it: the device's share, the CPU's (a hybrid layer),
/// and the unit the engine brings neurons into (a unit layer).
pub(super) type UnitLayerFfn<'a, B> = (
    FfnView<'a, B>,
    Option<ColdView<'a, B>>,
    Option<Box<dyn NeuronUnit<B> + 'a>>,
);

impl<B: Backend> UnitFfns<B> {
    /// What the units have moved so far.
    pub(super) fn traffic(&self) -> Arc<UnitTraffic> {
        self.traffic.clone()
    }

    /// Layer `l`'s FFN for one step, its norms and biases in `sm`.
    pub(super) fn layer<'a>(
        &'a mut self,
        l: usize,
        sm: &'a Small<B>,
    ) -> Result<UnitLayerFfn<'a, B>> {
        let UnitFfns {
            layers,
            staging,
            partial,
            bundle,
            gated,
            precision,
            traffic,
        } = self;
        match &mut layers[l] {
            LayerFfn::Hybrid { hot, hot_ids, cold } => {
                let partial = partial
                    .as_mut()
                    .ok_or_else(|| weights_err("a hybrid layer without its merge buffer"))?;
                let ffn = hot.view(sm, *bundle, *gated);
                let cold = ColdView {
                    neurons: &*cold,
                    hot: hot_ids,
                    merge: ColdMerge::Add(partial),
                };
                Ok((ffn, Some(cold), None))
            }
            LayerFfn::Unit(layer) => {
                let ffn = FfnView::Bundles {
                    runs: Vec::new(),
                    shape: *bundle,
                    up_bias: None,
                    down_bias: sm.down_bias.as_ref(),
                };
                let unit = Box::new(UnitStep {
                    layer,
                    staging,
                    precision: *precision,
                    traffic,
                });
                Ok((ffn, None, Some(unit)))
            }
        }
    }
}

/// The hot neurons of layer `l` where `hybrid` runs it hybrid.
fn hot_of(hybrid: Option<&HybridLayers>, l: usize) -> Option<&Vec<u32>> {
    hybrid
        .and_then(|h| h.hot_neurons.get(l))
        .and_then(Option::as_ref)
}

/// Cache units need bundles, and per layer 1..=d_ff slots in each tier `precision` uses and
/// none in the others (none at all in a layer `hybrid` runs hybrid).
fn check_slots(
    store: &Store,
    slots: &[[usize; 3]],
    precision: Precision,
    hybrid: Option<&HybridLayers>,
) -> Result<()> {
    let spec = &store.manifest.spec;
    let (n_layers, d_ff) = (spec.n_layers, spec.d_ff);
    if !store.ffn_bundled() {
        return Err(weights_err(
            "cache units hold neuron bundles: this model's FFN is stored as matrices (convert it with --bundle-ffn)",
        ));
    }
    let sized = |k: &[usize; 3]| {
        (0..3).all(|i| {
            if precision.0[i] > 0 {
                (1..=d_ff).contains(&k[i])
            } else {
                k[i] == 0
            }
        })
    };
    if hybrid.is_some_and(|h| h.hot_neurons.len() != n_layers || h.cold_cost.len() != n_layers) {
        return Err(weights_err(
            "the hybrid layers' plan has another number of layers",
        ));
    }
    if slots.len() != n_layers
        || !(0..n_layers).all(|l| match hot_of(hybrid, l) {
            Some(_) => slots[l] == [0; 3],
            None => sized(&slots[l]),
        })
    {
        return Err(weights_err(format!(
            "cache units at precision {precision} need 1..={d_ff} slots in each used tier (none in the others) for each of the {n_layers} layers"
        )));
    }
    Ok(())
}

/// What every layer's unit is made of: its slots per tier, its precision, what stale neurons
/// give way by, and the bundles' shape.
struct UnitShape<'a> {
    slots: &'a [[usize; 3]],
    precision: Precision,
    score: Option<&'a [Vec<f32>]>,
    bundle: BundleShape,
    d_ff: usize,
}

impl<B: Backend> LayerUnit<B> {
    /// Layer `l`'s neurons read into DRAM for `cpu` (f16, and the store's bundles of each other
    /// tier used), and its empty unit of `units.slots[l]` slots per tier.
    fn load(
        b: &B,
        store: &Store,
        ledger: &Arc<Ledger>,
        l: usize,
        units: &UnitShape,
        cpu: CpuSide,
    ) -> Result<Self> {
        let UnitShape {
            slots,
            precision,
            score,
            bundle,
            d_ff,
        } = *units;
        let neurons = ColdLayer::bundle_rows(store, ledger, l, 0..d_ff, cpu)?;
        let eviction = match score {
            Some(s) => s
                .get(l)
                .cloned()
                .ok_or_else(|| weights_err("a score for every layer"))?,
            None => vec![0.0; d_ff],
        };
        let seg = part_segment_name(l, Part::Ffn);
        let mut tiers: [Option<TierUnit<B>>; 3] = Default::default();
        for tier in precision.tiers() {
            let k = slots[l][tier];
            let enc = TIER_ENCODINGS[tier];
            let name = format!("{seg} unit {}", enc.name());
            let dram = if tier == 0 {
                None
            } else {
                Some(DramBundles::read(store, ledger, l, tier)?)
            };
            // Every neuron from 0 where it rests: the f16 copy or this tier's.
            let host = match &dram {
                Some(d) => Some(&d.bytes),
                None => neurons.bundles().map(|t| &t.data),
            };
            let in_place = match host {
                Some(bytes) if !neurons.has_up_bias() => Some(b.map_bundles(
                    &format!("{seg} {} in host memory", enc.name()),
                    enc,
                    bundle,
                    bytes,
                )?),
                _ => None,
            };
            tiers[tier] = Some(TierUnit {
                dram,
                in_place,
                map: SlotMap::new(d_ff, k, Eviction::Frequency(eviction.clone()))
                    .map_err(|e| weights_err(e.to_string()))?,
                unit: b.alloc_bundles(&name, enc, bundle, k)?,
                slot_bias: if neurons.has_up_bias() {
                    Some(b.alloc_weight(&format!("{name} up bias"), DType::F32, k, 1)?)
                } else {
                    None
                },
            });
        }
        Ok(LayerUnit { neurons, tiers })
    }
}

impl<B: Backend> Staging<B> {
    /// Per tier used, a device buffer of as many bundles as that tier's largest region (with
    /// their up biases where `biased`), and the host buffers misses are gathered into.
    fn alloc(b: &B, ledger: &Arc<Ledger>, units: &UnitShape, biased: bool) -> Result<Self> {
        let UnitShape {
            slots,
            precision,
            bundle,
            ..
        } = *units;
        let d = bundle.d;
        let mut tiers: [Option<StagingTier<B>>; 3] = Default::default();
        let (mut host_bytes, mut host_rows) = (0, 0);
        for tier in precision.tiers() {
            let widest = slots.iter().map(|k| k[tier]).max().unwrap_or(0);
            if widest == 0 {
                continue;
            }
            let enc = TIER_ENCODINGS[tier];
            let name = format!("unit staging {}", enc.name());
            host_bytes = host_bytes.max(widest * enc.row_bytes(bundle.parts * d, bundle.parts));
            host_rows = host_rows.max(widest);
            tiers[tier] = Some((
                b.alloc_bundles(&name, enc, bundle, widest)?,
                if biased {
                    Some(b.alloc_weight(&format!("{name} up bias"), DType::F32, widest, 1)?)
                } else {
                    None
                },
            ));
        }
        Ok(Staging {
            tiers,
            host: HostStaging::new(b, ledger, host_bytes, "unit staging (host)")?,
            host_bias: HostStaging::new(
                b,
                ledger,
                if biased { host_rows * 4 } else { 0 },
                "unit staging up bias (host)",
            )?,
        })
    }
}

/// A layer's unit as the engine drives it for one step.
struct UnitStep<'a, B: Backend> {
    layer: &'a mut LayerUnit<B>,
    staging: &'a mut Staging<B>,
    precision: Precision,
    traffic: &'a UnitTraffic,
}

impl<B: Backend> UnitStep<'_, B> {
    fn tier(&self, tier: usize) -> Result<&TierUnit<B>> {
        self.layer.tiers[tier]
            .as_ref()
            .ok_or_else(|| weights_err(format!("this unit has no precision tier {tier}")))
    }
}

impl<B: Backend> NeuronUnit<B> for UnitStep<'_, B> {
    fn active(
        &self,
        x: &[f32],
        n: usize,
        threshold: f32,
        keep: Option<&[bool]>,
        scores: Option<&[f32]>,
    ) -> Result<[TierSet; 3]> {
        let d_ff = self.layer.neurons.d_ff();
        let p = self.precision;
        match keep {
            // The predictor names the set (M2Cache's path): nothing is read from DRAM to
            // decide, and the kernels still apply the mask.
            Some(keep) => {
                let ids: Vec<u32> = (0..d_ff as u32)
                    .filter(|&j| (0..n).any(|t| keep[t * d_ff + j as usize]))
                    .collect();
                Ok(split_by_precision(p, d_ff, n, &ids, Some(keep), |t, i| {
                    let at = t * d_ff + ids[i] as usize;
                    keep[at].then(|| scores.map_or(1.0, |s| s[at]))
                }))
            }
            None if p == Precision::FP16 || n == 1 && !p.mixed() => {
                let ids = self.layer.neurons.active_ids(x, n, threshold, None)?;
                Ok(split_by_precision(p, d_ff, n, &ids, None, |_, _| Some(0.0)))
            }
            // The exact mask ranks by the activations' magnitudes.
            None => {
                let (ids, acts) = self.layer.neurons.active_scored(x, n, threshold)?;
                let a = ids.len();
                Ok(split_by_precision(p, d_ff, n, &ids, None, |t, i| {
                    let v = acts[t * a + i];
                    (v != 0.0).then(|| v.abs())
                }))
            }
        }
    }

    fn mixed(&self) -> bool {
        self.precision.mixed()
    }

    fn slots(&self, tier: usize) -> usize {
        self.layer.tiers[tier].as_ref().map_or(0, |t| t.map.slots())
    }

    fn bring(&mut self, b: &B, tier: usize, neurons: &[u32]) -> Result<Vec<u32>> {
        let Some(unit) = self.layer.tiers[tier].as_mut() else {
            return Err(weights_err(format!(
                "this unit has no precision tier {tier}"
            )));
        };
        let loads = unit
            .map
            .update(neurons)
            .map_err(|e| weights_err(e.to_string()))?;
        self.bring_in(b, tier, neurons.len(), &loads)?;
        self.tier(tier)?
            .map
            .slots_of(neurons)
            .ok_or_else(|| weights_err("a neuron just brought in is not in the unit"))
    }

    fn unit(&self, tier: usize) -> Result<(&B::Weight, Option<&B::Weight>)> {
        let t = self.tier(tier)?;
        Ok((&t.unit, t.slot_bias.as_ref()))
    }

    fn in_place(&self, tier: usize) -> Option<&B::Weight> {
        self.layer.tiers[tier].as_ref()?.in_place.as_ref()
    }

    fn hold(&mut self, b: &B, tier: usize, neurons: &[u32]) -> Result<Vec<u32>> {
        let Some(unit) = self.layer.tiers[tier].as_mut() else {
            return Err(weights_err(format!(
                "this unit has no precision tier {tier}"
            )));
        };
        if unit.in_place.is_none() {
            return Err(weights_err("this unit computes no neuron in place"));
        }
        // Free slots go to the most valued of the misses; nothing held is evicted: a miss is
        // read once in place, where bringing it in would read it and write it again.
        let free = unit.map.slots() - unit.map.held();
        let loads = if free == 0 {
            Vec::new()
        } else {
            let mut wanted = neurons.to_vec();
            let map = &unit.map;
            wanted.sort_by(|&a, &c| map.value(c).total_cmp(&map.value(a)).then(a.cmp(&c)));
            unit.map
                .admit(&wanted, free)
                .map_err(|e| weights_err(e.to_string()))?
                .1
        };
        self.bring_in(b, tier, neurons.len(), &loads)?;
        let map = &self.tier(tier)?.map;
        let entries: Vec<u32> = neurons
            .iter()
            .map(|&j| map.slot_of(j).unwrap_or(j | IN_REST))
            .collect();
        let n = entries.iter().filter(|&&e| e & IN_REST != 0).count() as u64;
        self.traffic.in_place.fetch_add(n, Ordering::Relaxed);
        Ok(entries)
    }
}

impl<B: Backend> UnitStep<'_, B> {
    /// Count `needed` neurons and copy `loads` into tier `tier`'s region; where the copy fails
    /// the unit forgets them (it must not claim neurons it never received).
    fn bring_in(
        &mut self,
        b: &B,
        tier: usize,
        needed: usize,
        loads: &[super::atu::Load],
    ) -> Result<()> {
        self.traffic
            .needed
            .fetch_add(needed as u64, Ordering::Relaxed);
        if loads.is_empty() {
            return Ok(());
        }
        self.load(b, tier, loads).inspect_err(|_| {
            if let Some(unit) = self.layer.tiers[tier].as_mut() {
                unit.map.forget(loads);
            }
        })
    }

    /// Copy `loads` into tier `tier`'s region: gathered into one host buffer, sent in one
    /// copy, scattered into their slots.
    fn load(&mut self, b: &B, tier: usize, loads: &[super::atu::Load]) -> Result<()> {
        let LayerUnit { neurons, tiers } = &mut *self.layer;
        let Some(unit) = tiers[tier].as_mut() else {
            return Err(weights_err(format!(
                "this unit has no precision tier {tier}"
            )));
        };
        let st = &mut *self.staging;
        let Some((st_bundles, st_bias)) = st.tiers[tier].as_mut() else {
            return Err(weights_err(format!("no staging for precision tier {tier}")));
        };
        let ids: Vec<u32> = loads.iter().map(|l| l.neuron).collect();
        let slots: Vec<u32> = loads.iter().map(|l| l.slot).collect();
        let host = st.host.stage.bytes_mut();
        let host_bias = st.host_bias.stage.values_mut();
        let (n_bytes, n_bias) = match &unit.dram {
            Some(d) => (d.gather(&ids, host)?, neurons.gather_bias(&ids, host_bias)?),
            None => neurons.gather(&ids, host, host_bias)?,
        };
        crate::engine::trace::add_cpu_bytes(n_bytes as u64);
        // The staging buffers are free once the compute queued so far (the last scatter out
        // of them) is done.
        let free = b.compute_done()?;
        b.copies_wait(&free)?;
        let copy = span(Phase::H2d);
        b.upload_into(st_bundles, 0, &st.host.stage.bytes()[..n_bytes])?;
        let mut bytes = n_bytes;
        if let (Some(sb), Some(_)) = (st_bias.as_mut(), &unit.slot_bias) {
            let values: &[u8] = &st.host_bias.stage.bytes()[..n_bias * 4];
            b.upload_into(sb, 0, values)?;
            bytes += values.len();
        }
        let landed = b.copies_done()?;
        drop(copy);
        super::compute_waits_for(b, &landed)?;
        let scatter = span(Phase::Scatter);
        b.scatter_rows(st_bundles, &slots, &mut unit.unit)?;
        if let (Some(sb), Some(dst)) = (st_bias.as_ref(), &mut unit.slot_bias) {
            b.scatter_rows(sb, &slots, dst)?;
        }
        drop(scatter);
        // The host buffer is refilled by the next load: the copy must have read it.
        let _wait = span(Phase::HostWait);
        b.host_waits(&landed)?;
        let n = loads.len() as u64;
        self.traffic.loads.fetch_add(n, Ordering::Relaxed);
        self.traffic.tier_loads[tier].fetch_add(n, Ordering::Relaxed);
        self.traffic
            .bytes
            .fetch_add(bytes as u64, Ordering::Relaxed);
        Ok(())
    }
}

impl<B: Backend> WeightSource<B> for UnitWeights<B> {
    resident_source!();

    fn layer(&mut self, _: &B, l: usize) -> Result<LayerView<'_, B>> {
        let UnitWeights { resident, ffns } = self;
        let (ffn, cold, unit) = ffns.layer(l, resident.small(l))?;
        Ok(resident.layer(l, ffn, cold, unit))
    }
}
