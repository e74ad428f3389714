//! The plan of cache units (`--cold gpu`, M2Cache): everything but the FFN resident as in hybrid
//! execution, and in what is left one unit of neuron slots per layer, sized in proportion to the
//! layer's mean active count (from the profile at the target sparsity), as large as the budget
//! holds; a staging buffer the size of the largest unit carries the misses in. Its device bytes
//! are counted the way [`crate::tier::units::UnitWeights`] allocates them.
//!
//! The expected loads per token take each neuron as active independently with its profile
//! frequency `f`, reused from the previous token: `Σ f·(1 − f)` for a unit that holds a token's
//! set, the whole set where it does not (`bench units` measures the real reuse, which spare
//! slots raise).
//!
//! With mixed precision each tier's region is sized by its share `s` of the active set and
//! its encoding's bytes; a neuron is taken to fall in a tier independently of the last token's
//! rank, so the tier loads `Σ f·s·(1 − f·s)` (ranks of adjacent tokens correlate: fewer move).
//!
//! Where `bench units` has measured the ATU's hit ratio for the layer at that size (kept in the
//! profile), a single-precision unit's loads are the measured misses instead.
//!
//! Where every layer's attention does not fit beside units of one slot,
//! [`plan_units_streamed`] places the units in a reserve of the streaming plan instead:
//! attention resident by rows as far as the rest allows and streamed through the window's slots
//! beyond, the reserve chosen by the prediction, in which a layer's time takes the larger of its
//! compute (its loads waiting behind the streamed attention on the link) and the link's bytes
//! (its attention's streamed rows and its loads).
//!
//! Sizing bisects one scale for every layer's unit (60 rounds of the units' bytes). Fails where
//! the FFN is not stored as bundles, the store lacks a tier's encoding, the profile is not the
//! model's, or units of one slot do not fit beside everything else (streamed attention: beside
//! one streaming slot and what every plan holds).

use serde::Serialize;

use crate::footprint::device_bytes;
use crate::sparsity::{SparsityProfile, grid_index};
use crate::store::{Encoding, Manifest, names};

use super::Plan;
use super::batch;
use super::budget::{Budget, PlanError, human_bytes};
use super::cold::{ColdCost, PredictorCost, hot_device_bytes};
use super::cost::HostKv;
use super::hardware::HardwareProfile;
use super::hybrid::{HybridPlan, plan_hot_streamed, predictors_for};
use super::manifest::{part_segment_name, seg};
use super::precision::{Precision, TIER_ENCODINGS};
use super::preserve::Part;
use super::resident::{BaseFor, SparsePerToken, base_of, layers_of};
use super::stream::make_plan;

/// How a layer's FFN runs in a cache-unit plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum UnitMode {
    /// A cache unit: every active neuron on the device, the unit's misses copied in.
    Unit,
    /// Hybrid: hot neurons resident on the device, the CPU computes the rest from DRAM.
    Hybrid,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct UnitLayer {
    pub mode: UnitMode,
    /// Slots of the region of each precision tier (f16, INT8, INT4); none for a hybrid layer.
    pub slots: [usize; 3],
    /// Hot neurons resident (hybrid layers).
    pub hot: usize,
    /// Device bytes the layer's FFN holds (its unit, or its hot neurons).
    pub device_bytes: u64,
    /// Predicted seconds per token of the layer (attention and FFN).
    pub seconds: f64,
    /// Expected bytes per token the layer's FFN reads on the device (a unit's: its active
    /// neurons and the loads it scatters), reads from DRAM on the CPU (its deciding vectors and
    /// the misses it gathers), and moves over PCIe.
    pub ffn_bytes: [u64; 3],
    /// Bytes of the layer's attention streamed in per token (0: resident).
    pub attention_streamed: u64,
    /// Mean neurons active per token (per step: the union of its sequences').
    pub mean_active: f64,
    /// Expected neurons brought in per token (per step).
    pub expected_loads: f64,
    /// Expected neurons computed where they rest in host memory, read in place over the link,
    /// per token (per step).
    pub expected_in_place: f64,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct UnitDevice {
    /// Every layer's attention matrices, whole; or, streamed, every layer's resident rows
    /// and the streaming slots.
    pub attention: u64,
    /// The units and their slot-ordered up biases.
    pub units: u64,
    /// Hybrid layers' hot neurons and the merge buffer of their CPU sums.
    pub hybrid: u64,
    /// The staging buffers misses come in by.
    pub staging: u64,
    /// Everything the byte ledger holds at the peak.
    pub placed: u64,
    /// `fixed + placed`.
    pub total: u64,
}

#[derive(Clone, Debug, Serialize)]
pub struct UnitPlan {
    pub target: f64,
    /// Shares of each token's active neurons in f16, INT8 and INT4.
    pub precision: Precision,
    /// Unit sizes as a multiple of each layer's mean active count.
    pub scale: f64,
    pub layers: Vec<UnitLayer>,
    /// Bytes of one neuron in each tier's encoding (and its up bias where there is one).
    pub neuron_bytes: [u64; 3],
    pub device: UnitDevice,
    /// DRAM the neurons take (every layer's bundles in each encoding used).
    pub dram_neurons: u64,
    /// Sequences a decode step evaluates a token of: the layers' figures and `per_token` are of
    /// one such step (of one token where a sequence decodes alone), the prediction their
    /// aggregate tokens/s.
    pub sequences: usize,
    pub per_token: SparsePerToken,
    pub predicted_tokens_per_s: f64,
    /// Per layer, the predictor that names each step's neurons and what it costs
    /// (`--sparsity predicted`; none with the threshold's mask).
    pub predictors: Option<Vec<PredictorCost>>,
    /// Per layer, what a stale neuron's stay is worth (its frequency; what the ATU evicts by).
    #[serde(skip)]
    pub scores: Vec<Vec<f32>>,
    /// The hybrid layers' placement, where some layers run hybrid.
    #[serde(skip)]
    pub hybrid: Option<HybridLayers>,
    /// With streamed attention: the streaming plan it runs on (attention residency, slots,
    /// the reserve the units and their staging take).
    #[serde(skip)]
    pub base_plan: Option<Box<Plan>>,
}

/// What the hybrid layers of a mixed plan hold.
#[derive(Clone, Debug)]
pub struct HybridLayers {
    /// Per layer, the hot neurons of a hybrid layer (ascending); `None` for a unit layer.
    pub hot_neurons: Vec<Option<Vec<u32>>>,
    pub cold_cost: Vec<ColdCost>,
    /// Rows of the merge buffer.
    pub batch: usize,
}

impl UnitPlan {
    /// Slots of each layer's unit, by precision tier.
    pub fn slots(&self) -> Vec<[usize; 3]> {
        self.layers.iter().map(|l| l.slots).collect()
    }
}

/// Device bytes of units of `slots` (per tier) and the staging buffers (per tier, as wide as
/// its widest region) for neurons of `row[tier]` bytes, with a slot-ordered up bias where
/// `biased`: as the source allocates them.
fn unit_device_bytes(slots: &[[usize; 3]], row: [u64; 3], biased: bool) -> (u64, u64) {
    let one = |k: usize, tier: usize| {
        if k == 0 {
            return 0;
        }
        device_bytes(k as u64 * row[tier])
            + if biased {
                device_bytes(k as u64 * 4)
            } else {
                0
            }
    };
    let units = slots
        .iter()
        .map(|k| (0..3).map(|i| one(k[i], i)).sum::<u64>())
        .sum();
    let staging = (0..3)
        .map(|i| one(slots.iter().map(|k| k[i]).max().unwrap_or(0), i))
        .sum();
    (units, staging)
}

/// What sizes the units of a plan: a neuron's bundle bytes in each tier's encoding (without
/// its up bias), whether neurons carry an up bias, where attention is held, everything else on
/// the device, and the device bytes left for units and their staging.
#[derive(Clone)]
struct UnitRoom {
    row: [u64; 3],
    biased: bool,
    /// Everything placed beside the units, their staging and any hybrid layers.
    everything_else: u64,
    /// Device bytes attention takes: every layer's matrices, or (streamed) every layer's
    /// resident rows and the streaming slots.
    attention: u64,
    /// Per layer, the attention matrices' bytes (what the device reads of them per token).
    attention_layers: Vec<u64>,
    /// Attention bytes each layer streams in per token (0: all resident).
    streamed: u64,
    /// Device bytes left for the units and their staging (and hybrid layers, their merge).
    room: u64,
    /// The streaming plan attention streams by, where it does.
    base_plan: Option<Box<Plan>>,
}

/// A neuron's bundle bytes in each tier's encoding (without its up bias), and whether neurons
/// carry an up bias.
fn neuron_rows(m: &Manifest) -> ([u64; 3], bool) {
    let spec = &m.spec;
    let parts = if spec.gated_ffn { 3 } else { 2 };
    (
        TIER_ENCODINGS.map(|e| e.row_bytes(parts * spec.d_model, parts) as u64),
        m.segment(&names::layer(0, "ffn_up.bias")).is_some(),
    )
}

/// The room of units beside every layer's attention resident.
fn unit_room(m: &Manifest, plan: &Plan) -> Result<UnitRoom, PlanError> {
    let (base, _) = base_of(m, plan, BaseFor::Units)?;
    let g = &plan.gpu;
    // One step's buffers are left free beside the units: steps of another size (prefill,
    // then decode) reallocate them, and a budget filled exactly has its free bytes in pieces
    // too small for them (seen on SmolLM2 at 70M: the logits buffer refused).
    let room = plan
        .budget
        .gpu_mem
        .saturating_sub(g.fixed)
        .saturating_sub(base.everything_else)
        .saturating_sub(g.scratch);
    let (row, biased) = neuron_rows(m);
    Ok(UnitRoom {
        row,
        biased,
        everything_else: base.everything_else,
        attention: base.attention,
        attention_layers: base.attention_layers,
        streamed: 0,
        room,
        base_plan: None,
    })
}

/// The room of units in the reserve of `base`, a streaming plan with the FFN off the device
/// (`Budget::unit_reserve`): attention resident by rows as far as it fits and streamed beyond
/// (the plan leaves one step's buffers free beside the reserve, as beside resident attention).
fn streamed_room(m: &Manifest, base: Plan) -> Result<UnitRoom, PlanError> {
    let Some(reserve) = base.budget.unit_reserve else {
        return Err(PlanError::Budget(
            "cache units with streamed attention need a plan with a reserve for them".into(),
        ));
    };
    if !base.residency.ffn_off {
        return Err(PlanError::Budget(
            "the budget holds every layer: cache units keep attention resident".into(),
        ));
    }
    let (_, attention_layers) = layers_of(m, base.spec.n_layers)?;
    let g = &base.gpu;
    let (row, biased) = neuron_rows(m);
    Ok(UnitRoom {
        row,
        biased,
        everything_else: g.placed,
        attention: g.resident_layers + g.slots,
        attention_layers,
        streamed: base.streamed_bytes_per_layer,
        room: reserve,
        base_plan: Some(Box::new(base)),
    })
}

/// Cache units for `plan`'s budget (everything but the FFN resident; its KV and step memory)
/// at neuron `precision`: their sizes from `profile`'s frequencies at `target` (or `target`
/// alone), and what they hold and move.
pub fn plan_units(
    m: &Manifest,
    plan: &Plan,
    profile: Option<&SparsityProfile>,
    target: f64,
    precision: Precision,
) -> Result<UnitPlan, PlanError> {
    check_units(m, plan, profile, precision)?;
    let room = unit_room(m, plan)?;
    plan_units_in(m, plan, room, profile, target, precision)
}

/// Each layer's neurons as a step needs them: the profile's frequencies at `target` (every
/// neuron at `1 − target` without one), and the share of a step of `rows` sequences' union (of
/// the sets the `predictors` name, where they decide).
fn step_frequencies(
    spec: &crate::model::ModelSpec,
    profile: Option<&SparsityProfile>,
    target: f64,
    rows: usize,
    predictors: Option<&[PredictorCost]>,
) -> (Vec<Vec<f64>>, Vec<Vec<f64>>) {
    let k = grid_index(target);
    let freqs: Vec<Vec<f64>> = (0..spec.n_layers)
        .map(|l| match profile {
            Some(p) => p.frequencies(l, k),
            None => vec![1.0 - target; spec.d_ff],
        })
        .collect();
    // A decode step of `rows` sequences needs the union of their active sets: a neuron with
    // frequency f is in it with 1 − (1 − f)^rows ([`super::batch`]). Units are sized for it.
    // With predictors, the sets are the neurons they name.
    let needed = freqs
        .iter()
        .enumerate()
        .map(|(l, f)| {
            let pc = predictors.and_then(|p| p.get(l));
            f.iter()
                .map(|&p| batch::union_share(pc.map_or(p, |pc| pc.names(p)), rows))
                .collect()
        })
        .collect();
    (freqs, needed)
}

/// Cache units in `room` (attention resident or streamed as it says) for `plan`'s budget.
fn plan_units_in(
    m: &Manifest,
    plan: &Plan,
    room: UnitRoom,
    profile: Option<&SparsityProfile>,
    target: f64,
    precision: Precision,
) -> Result<UnitPlan, PlanError> {
    let spec = &plan.spec;
    let (n_layers, d_ff, d) = (spec.n_layers, spec.d_ff, spec.d_model);
    let share = precision.0.map(|p| p as f64 / 100.0);
    let rows = batch::step_rows(&plan.budget, &plan.prefill);
    let predictors = predictors_for(plan, profile);
    let (freqs, needed) = step_frequencies(spec, profile, target, rows, predictors.as_deref());
    let means: Vec<f64> = needed.iter().map(|f| f.iter().sum::<f64>()).collect();
    let lo = largest_scale(plan, &room, &means, share)?;
    let (row, biased) = (room.row, room.biased);
    let neuron_bytes = row.map(|r| r + if biased { 4 } else { 0 });
    let g = &plan.gpu;
    let slots = slots_at(&means, share, d_ff, lo);
    let (units, staging) = unit_device_bytes(&slots, row, biased);

    // The measured reuse is of one sequence's trace: a step of several keeps the independent
    // estimate of its union.
    let reuse = profile
        .and_then(|p| p.unit_reuse.as_ref())
        .filter(|_| rows == 1 && predictors.is_none());
    let hw = &plan.hardware;
    let r = rows as u64;
    let costs = LayerCosts::new(plan, &room, rows, predictors.clone());
    let mut layers = Vec::with_capacity(n_layers);
    // The device reads every layer's attention, from where it rests or from a slot.
    let attention_read = match room.base_plan {
        Some(_) => room.attention_layers.iter().sum(),
        None => room.attention,
    };
    let (mut hbm, mut cpu, mut pcie) = (g.small + g.head + attention_read, 0u64, 0u64);
    let mut seconds = 0.0;
    // Without an up bias (whose values go by slot) a unit computes the neurons it does not
    // hold where they rest in host memory, read in place over the link; its free slots fill
    // with the most valued neurons and nothing held is evicted.
    let in_place = !biased;
    for (l, (f, &mu)) in needed.iter().zip(&means).enumerate() {
        let k = slots[l];
        if in_place {
            let u = in_place_unit(
                &costs,
                (l, f, mu, k),
                (precision, row, biased),
                room.streamed,
            );
            hbm += u.ffn_bytes[0];
            cpu += u.ffn_bytes[1];
            pcie += u.ffn_bytes[2] + room.streamed + costs.kv_in;
            cpu += costs.kv_cpu;
            seconds += u.seconds;
            layers.push(u);
            continue;
        }
        let (mut loads, mut active, mut moved) = (0.0, 0.0, 0.0);
        for i in precision.tiers() {
            let s = share[i];
            // Measured where `bench units` measured a unit of that size. Its trace is of
            // single-precision units: how often a neuron changes tier is not measured, so mixed
            // precision keeps the independent estimate.
            let measured = reuse
                .filter(|_| !precision.mixed())
                .and_then(|r| r.hit_ratio(target, l, k[i] as f64));
            let tier_loads = match measured {
                Some(hit) => s * mu * (1.0 - hit),
                None if k[i] as f64 >= s * mu => {
                    f.iter().map(|p| p * s * (1.0 - p * s)).sum::<f64>()
                }
                None => s * mu,
            };
            loads += tier_loads;
            active += s * mu * row[i] as f64;
            moved += tier_loads * neuron_bytes[i] as f64;
        }
        let (active, moved) = (active as u64, moved as u64);
        // A step's set comes in as many rounds as its tiers' regions take to hold it.
        let rounds: f64 = precision
            .tiers()
            .map(|i| (share[i] * mu / k[i].max(1) as f64).ceil().max(1.0))
            .sum();
        let layer_s = costs.unit_layer(l, active, moved, mu, rounds);
        let decided = costs.deciding(l).0 as u64;
        // The misses are gathered from DRAM into the staging buffer, then scattered from it
        // into their slots on the device.
        hbm += active + moved;
        cpu += decided + moved;
        pcie += moved + r * (d * 4) as u64 + room.streamed + costs.kv_in;
        cpu += costs.kv_cpu;
        seconds += layer_s;
        layers.push(UnitLayer {
            mode: UnitMode::Unit,
            slots: k,
            hot: 0,
            device_bytes: unit_device_bytes(&[k], row, biased).0,
            seconds: layer_s,
            ffn_bytes: [active + moved, decided + moved, moved + r * (d * 4) as u64],
            attention_streamed: room.streamed,
            mean_active: mu,
            expected_loads: loads,
            expected_in_place: 0.0,
        });
    }
    let per_session = g.kv / plan.budget.sessions.max(1) as u64;
    hbm += r * per_session / 2;
    seconds += batch::bounded(
        (g.head + r * per_session / 2) as f64,
        hw.hbm_bytes_per_s,
        rows,
        batch::head_flops(spec),
        hw.matmul_flops_per_s,
    );
    // About 16 ops a layer (norms, projections, rope, attention, the listed FFN, scatter).
    seconds += (n_layers * 16 + 4) as f64 * hw.op_overhead_s;
    pcie += r * (spec.d_model + spec.vocab_size) as u64 * 4;
    let dram_neurons = dram_neurons(m, precision, n_layers)?;
    let placed = room.everything_else + units + staging;
    Ok(UnitPlan {
        target,
        precision,
        scale: lo,
        layers,
        neuron_bytes,
        device: UnitDevice {
            attention: room.attention,
            units,
            hybrid: 0,
            staging,
            placed,
            total: g.fixed + placed,
        },
        dram_neurons,
        sequences: rows,
        per_token: SparsePerToken::of_bytes(hbm, cpu, pcie),
        predicted_tokens_per_s: rows as f64 / seconds,
        scores: freqs
            .iter()
            .map(|f| f.iter().map(|&p| p as f32).collect())
            .collect(),
        hybrid: None,
        predictors,
        base_plan: room.base_plan,
    })
}

/// Layer `l` as a cache unit of `k` slots per tier that reads the neurons it does not hold in
/// place over the link (`f`: each neuron's share of the steps, `mu` their sum): its slots keep
/// the most valued neurons, the rest of each step's set is read where it rests. With oracle
/// masks on one tier the device decides: every neuron is listed and read up to its deciding
/// part (the host decides nothing); otherwise the host decides and only the active are listed.
fn in_place_unit(
    costs: &LayerCosts,
    (l, f, mu, k): (usize, &[f64], f64, [usize; 3]),
    (precision, row, biased): (Precision, [u64; 3], bool),
    streamed: u64,
) -> UnitLayer {
    let share = precision.0.map(|p| p as f64 / 100.0);
    let on_device = costs.predictors.is_none() && !precision.mixed();
    let parts = costs.parts as f64;
    let mut by_value = f.to_vec();
    by_value.sort_by(|a, b| b.total_cmp(a));
    let d_ff = by_value.len();
    let (mut held, mut read, mut missed, mut calls) = (0.0, 0.0, 0.0, 0.0);
    for i in precision.tiers() {
        let s = share[i];
        let kept = k[i].min(d_ff);
        let hits = by_value.iter().take(kept).sum::<f64>() * s;
        let misses = match kept == d_ff {
            true => 0.0,
            false => (s * mu - hits).max(0.0),
        };
        let part = row[i] as f64 / parts;
        // Listed: every neuron (the device decides) or the active ones.
        let (listed_held, listed_rest) = match on_device {
            true => (kept as f64, (d_ff - kept) as f64),
            false => (hits, misses),
        };
        // The deciding part of each listed, the others of each active.
        held += listed_held * part + hits * (parts - 1.0) * part;
        read += listed_rest * part + misses * (parts - 1.0) * part;
        missed += misses;
        // One pair of listed kernels for the tier's whole list, slots and host memory alike
        // (`Engine::held_neurons`).
        if listed_held + listed_rest > 0.0 {
            calls += 1.0;
        }
    }
    let (held, read) = (held as u64, read as u64);
    let seconds = costs.in_place_layer(l, (held, read), mu, calls, on_device);
    let decided = if on_device {
        0
    } else {
        costs.deciding(l).0 as u64
    };
    let input = if on_device {
        0
    } else {
        (costs.rows * costs.plan.spec.d_model * 4) as u64
    };
    UnitLayer {
        mode: UnitMode::Unit,
        slots: k,
        hot: 0,
        device_bytes: unit_device_bytes(&[k], row, biased).0,
        seconds,
        ffn_bytes: [held, decided, read + input],
        attention_streamed: streamed,
        mean_active: mu,
        expected_loads: 0.0,
        expected_in_place: missed,
    }
}

/// What a layer's time is made of in a decode step of `rows` sequences: attention on the device
/// (read from where it rests), the FFN's neurons, the CPU's deciding vectors, the round trip,
/// and the copy link, which streamed attention shares with the units' loads.
struct LayerCosts<'a> {
    plan: &'a Plan,
    attention_layers: &'a [u64],
    streamed: u64,
    rows: usize,
    /// Bytes of a neuron's deciding vector (its gate or up row in f16).
    decide: u64,
    /// Parts of a bundle (3 gated, else 2).
    parts: usize,
    /// Per layer, the predictor that names the step's neurons in place of the deciding
    /// vectors (`--sparsity predicted`).
    predictors: Option<Vec<PredictorCost>>,
    attention_row: f64,
    sync: f64,
    /// Where the KV cache lives in host memory, what a layer's attention takes from it each
    /// step: the bytes the link brings in (its rows so far, half the context on average), or
    /// the bytes the CPU reads where it attends there.
    kv_in: u64,
    kv_cpu: u64,
}

impl<'a> LayerCosts<'a> {
    fn new(
        plan: &'a Plan,
        room: &'a UnitRoom,
        rows: usize,
        predictors: Option<Vec<PredictorCost>>,
    ) -> Self {
        let spec = &plan.spec;
        let hw = &plan.hardware;
        let parts = if spec.gated_ffn { 3 } else { 2 };
        let kv = HostKv::of(plan, rows);
        let per_layer = |bytes: u64| bytes / spec.n_layers.max(1) as u64;
        LayerCosts {
            plan,
            attention_layers: &room.attention_layers,
            streamed: room.streamed,
            rows,
            decide: Encoding::F16.row_bytes(parts * spec.d_model, parts) as u64 / parts as u64,
            parts,
            predictors,
            attention_row: batch::projection_flops(spec)
                + batch::attention_flops(spec, plan.budget.ctx / 2),
            sync: hw.op_overhead_s + (rows * spec.d_model * 4) as f64 / hw.h2d_pinned_bytes_per_s,
            kv_in: per_layer(kv.link),
            kv_cpu: per_layer(kv.cpu),
        }
    }

    /// What the host reads and computes to decide layer `l`'s set, a step: every neuron's
    /// deciding vector (bytes, and FLOPs per row), or its predictor's weights and products.
    fn deciding(&self, l: usize) -> (f64, f64) {
        let spec = &self.plan.spec;
        match self.predictors.as_ref().and_then(|p| p.get(l)) {
            Some(p) => (p.weight_bytes as f64, p.flops),
            None => (
                (spec.d_ff as u64 * self.decide) as f64,
                spec.d_ff as f64 * 2.0 * spec.d_model as f64,
            ),
        }
    }

    /// Seconds the CPU takes to attend a layer's host-kept cache (none where the device does).
    fn kv_cpu_s(&self) -> f64 {
        self.kv_cpu as f64 / self.plan.hardware.cpu_attention_rate()
    }

    /// Seconds of layer `l`'s attention on the device (and on the CPU, over a host-kept cache
    /// it attends).
    fn attention(&self, l: usize) -> f64 {
        let hw = &self.plan.hardware;
        batch::bounded(
            self.attention_layers[l] as f64,
            hw.hbm_bytes_per_s,
            self.rows,
            self.attention_row,
            hw.matmul_flops_per_s,
        ) + self.kv_cpu_s()
    }

    /// Seconds the copy link needs for layer `l`: its streamed attention, its host-kept KV
    /// rows and `moved` bytes beside (a step's the layers take in turn, so a layer takes at
    /// least its share).
    fn link(&self, moved: u64) -> f64 {
        (self.streamed + self.kv_in + moved) as f64 / self.plan.hardware.h2d_pinned_bytes_per_s
    }

    /// Seconds of layer `l` as a cache unit reading `active` bytes of neurons (`mu` of them) on
    /// the device, `moved` bytes of loads over the link in `rounds` (one per tier, more where a
    /// region is smaller than its share of the set): the device computes the step's union for
    /// every row, the CPU every deciding vector; each round past the first waits for its copy
    /// and runs its scatter and two listed kernels; the loads wait behind streamed attention.
    fn unit_layer(&self, l: usize, active: u64, moved: u64, mu: f64, rounds: f64) -> f64 {
        let spec = &self.plan.spec;
        let hw = &self.plan.hardware;
        let rows = self.rows;
        // The scatter reads the loads from the staging buffer and writes them into their slots.
        let device = batch::bounded(
            (self.attention_layers[l] + active) as f64,
            hw.hbm_bytes_per_s,
            rows,
            self.attention_row + mu * batch::neuron_flops(spec),
            hw.matmul_flops_per_s,
        ) + 2.0 * moved as f64 / hw.hbm_bytes_per_s
            + self.kv_cpu_s();
        let (decided, decide_flops) = self.deciding(l);
        // The CPU decides, then gathers the misses from DRAM into the staging buffer (the
        // trace's gather: on the budgeted device it took longer than their copy).
        let cpu = batch::bounded(
            decided,
            hw.dram_read_bytes_per_s,
            rows,
            decide_flops,
            batch::cpu_flops_per_s(hw),
        ) + moved as f64 / hw.dram_read_bytes_per_s;
        let extra_rounds = (rounds - 1.0).max(0.0) * (self.sync + 3.0 * hw.op_overhead_s);
        let compute = device
            + cpu
            + moved as f64 / hw.h2d_pinned_bytes_per_s
            + 2.0 * self.sync
            + extra_rounds;
        compute.max(self.link(moved))
    }

    /// Seconds of layer `l` as a cache unit computing `held` bytes of neurons from its slots
    /// and reading `read` bytes of the others in place over the link (`mu` neurons in all), in
    /// `calls` pairs of listed kernels: the CPU decides (unless the device does, `on_device`:
    /// no round trip), then the device computes; the reads share the link with streamed
    /// attention.
    fn in_place_layer(
        &self,
        l: usize,
        (held, read): (u64, u64),
        mu: f64,
        calls: f64,
        on_device: bool,
    ) -> f64 {
        let spec = &self.plan.spec;
        let hw = &self.plan.hardware;
        let device = batch::bounded(
            (self.attention_layers[l] + held) as f64,
            hw.hbm_bytes_per_s,
            self.rows,
            self.attention_row + mu * batch::neuron_flops(spec),
            hw.matmul_flops_per_s,
        ) + read as f64 / hw.h2d_pinned_bytes_per_s
            + self.kv_cpu_s();
        let launches = 2.0 * calls * hw.op_overhead_s;
        if on_device {
            return (device + launches).max(self.link(read));
        }
        let (decided, decide_flops) = self.deciding(l);
        let cpu = batch::bounded(
            decided,
            hw.dram_read_bytes_per_s,
            self.rows,
            decide_flops,
            batch::cpu_flops_per_s(hw),
        );
        let compute = device + cpu + 2.0 * self.sync + launches;
        compute.max(self.link(read))
    }

    /// Seconds of layer `l` run hybrid, its FFN's device and CPU shares taking `ffn_s` together:
    /// its attention and FFN, or the link carrying its streamed attention and the FFN's input
    /// and partial sum.
    fn hybrid_layer(&self, l: usize, ffn_s: f64) -> f64 {
        let vectors = (self.rows * 2 * self.plan.spec.d_model * 4) as u64;
        (self.attention(l) + ffn_s).max(self.link(vectors))
    }
}

/// What a store and profile must be for cache units at `precision`: bundles, in every encoding
/// the precision computes in, and a profile of the model's shape.
fn check_units(
    m: &Manifest,
    plan: &Plan,
    profile: Option<&SparsityProfile>,
    precision: Precision,
) -> Result<(), PlanError> {
    let spec = &plan.spec;
    let (n_layers, d_ff) = (spec.n_layers, spec.d_ff);
    if m.bundle_encodings.is_empty() {
        return Err(PlanError::Budget(
            "cache units hold neuron bundles: this model's FFN is stored as matrices (--cold cpu runs it sparse; convert --bundle-ffn bundles it)".into(),
        ));
    }
    for i in precision.tiers() {
        let enc = TIER_ENCODINGS[i];
        if !m.bundle_encodings.contains(&enc) {
            return Err(PlanError::Store(format!(
                "neuron precision {precision} computes neurons in {} but the store holds no {} bundles (convert with --encodings int8,int4)",
                enc.name(),
                enc.name()
            )));
        }
    }
    if let Some(p) = profile
        && (p.d_ff != d_ff || p.n_layers != n_layers)
    {
        return Err(PlanError::Store(
            "the sparsity profile's shape is not this model's".into(),
        ));
    }
    Ok(())
}

/// Slots of each layer's unit, per tier, at `scale` × the layer's mean active count (`means`)
/// × the tier's `share`: at least one in a used tier, at most every neuron.
fn slots_at(means: &[f64], share: [f64; 3], d_ff: usize, scale: f64) -> Vec<[usize; 3]> {
    means
        .iter()
        .map(|&mu| {
            [0, 1, 2].map(|i| {
                if share[i] > 0.0 {
                    ((scale * share[i] * mu).ceil() as usize).clamp(1, d_ff)
                } else {
                    0
                }
            })
        })
        .collect()
}

/// The largest scale of the units (× each layer's mean active count, `means`) whose units
/// and staging fit the room (all neurons at most), by bisection; refused where units of one
/// slot do not fit.
fn largest_scale(
    plan: &Plan,
    unit_room: &UnitRoom,
    means: &[f64],
    share: [f64; 3],
) -> Result<f64, PlanError> {
    let (n_layers, d_ff) = (plan.spec.n_layers, plan.spec.d_ff);
    let UnitRoom {
        row,
        biased,
        everything_else,
        attention,
        room,
        ..
    } = *unit_room;
    let g = &plan.gpu;
    let slack = g.scratch;
    let smallest =
        || -> Vec<[usize; 3]> { vec![[0, 1, 2].map(|i| usize::from(share[i] > 0.0)); n_layers] };
    let fits = |slots: &[[usize; 3]]| {
        let (u, st) = unit_device_bytes(slots, row, biased);
        u + st <= room
    };
    if !fits(&smallest()) {
        let (u, st) = unit_device_bytes(&smallest(), row, biased);
        let held = match unit_room.base_plan {
            Some(_) => format!(
                "cache units beside streamed attention (its resident rows and slots {})",
                human_bytes(attention)
            ),
            None => format!(
                "cache units keep every layer's attention resident ({})",
                human_bytes(attention)
            ),
        };
        return Err(PlanError::GpuTooSmall {
            budget: plan.budget.gpu_mem,
            minimum: g.fixed + everything_else + slack + u + st,
            breakdown: format!(
                "{held}, with the small fragments {}, output matrix {}, KV cache {}, step buffers {}, workspace {}, and units of one slot",
                human_bytes(g.small),
                human_bytes(g.head),
                human_bytes(g.kv),
                human_bytes(g.scratch),
                human_bytes(g.workspace)
            ),
        });
    }
    // The largest scale that fits (all neurons at most).
    let smallest_mean = means
        .iter()
        .copied()
        .fold(f64::INFINITY, f64::min)
        .max(1e-9);
    let (mut lo, mut hi) = (0.0, d_ff as f64 / smallest_mean + 1.0);
    if fits(&slots_at(means, share, d_ff, hi)) {
        lo = hi;
    } else {
        for _ in 0..60 {
            let mid = 0.5 * (lo + hi);
            if fits(&slots_at(means, share, d_ff, mid)) {
                lo = mid;
            } else {
                hi = mid;
            }
        }
    }
    Ok(lo)
}

/// DRAM the neurons take: every layer's bundles in each encoding `precision` uses, as read.
fn dram_neurons(m: &Manifest, precision: Precision, n_layers: usize) -> Result<u64, PlanError> {
    let mut dram_neurons = 0;
    for l in 0..n_layers {
        let s = seg(m, &part_segment_name(l, Part::Ffn))?;
        dram_neurons += s.read_extent(0..s.rows).1;
        for i in precision.tiers().filter(|&i| i > 0) {
            let s = seg(m, &names::bundles(l, TIER_ENCODINGS[i]))?;
            dram_neurons += s.read_extent(0..s.rows).1;
        }
    }
    Ok(dram_neurons)
}

/// Cache units at the fastest of the precisions `candidates` by the plan's prediction (the
/// earlier of equals); where none fits, the first one's refusal.
pub fn plan_units_fastest(
    m: &Manifest,
    plan: &Plan,
    profile: Option<&SparsityProfile>,
    target: f64,
    candidates: &[Precision],
) -> Result<UnitPlan, PlanError> {
    fastest_of(
        candidates
            .iter()
            .map(|&p| plan_units(m, plan, profile, target, p)),
        || PlanError::Budget("no neuron precision to plan for".into()),
    )
}

/// Per layer, the faster of `units`' cache unit and `hot`'s hybrid layer (hot neurons resident,
/// the CPU computing the rest) by the plans' predicted seconds, within the device room both
/// plans share: where the faster choices together exceed it, layers go back to their smaller
/// choice, least time lost per byte first. Where the units stream attention (a base plan), each
/// layer's choice is weighed with it: both choices read the layer's attention from where it
/// rests, and the copy link carries its streamed rows beside a unit's loads or hybrid's round
/// trip. `units` as it is where no layer is faster hybrid, or where only one of the two streams
/// attention (their layers then do not hold the same).
pub fn mix_with_hybrid(
    m: &Manifest,
    plan: &Plan,
    units: UnitPlan,
    hot: &HybridPlan,
) -> Result<UnitPlan, PlanError> {
    let n_layers = plan.spec.n_layers;
    if hot.base_plan.is_some() != units.base_plan.is_some()
        || hot.layers.len() != n_layers
        || units.layers.len() != n_layers
    {
        return Ok(units);
    }
    let room = match &units.base_plan {
        Some(base) => streamed_room(m, base.as_ref().clone())?,
        None => unit_room(m, plan)?,
    };
    let plan = room.base_plan.as_deref().unwrap_or(plan);
    let spec = &plan.spec;
    let g = &plan.gpu;
    let (row, biased) = (room.row, room.biased);
    let merge = device_bytes((hot.batch.max(1) * spec.d_model * 4) as u64);
    let rows = units.sequences;
    let costs = LayerCosts::new(plan, &room, rows, None);
    // Per layer: (seconds, device bytes) as a unit and as hybrid.
    let mut opts = Vec::with_capacity(n_layers);
    for (l, (u, h)) in units.layers.iter().zip(&hot.layers).enumerate() {
        let hybrid_s = costs.hybrid_layer(l, plan.hardware.together_s(h.gpu_s, h.cpu_s));
        let hybrid_b = hot_device_bytes(m, l, hot.hot_neurons[l].len())?;
        opts.push([(u.seconds, u.device_bytes), (hybrid_s, hybrid_b)]);
    }
    let Some(pick) = pick_modes(&opts, |pick| {
        let slots: Vec<[usize; 3]> = (0..n_layers)
            .map(|l| {
                if pick[l] == 0 {
                    units.layers[l].slots
                } else {
                    [0; 3]
                }
            })
            .collect();
        let (u, st) = unit_device_bytes(&slots, row, biased);
        let h: u64 = (0..n_layers)
            .filter(|&l| pick[l] == 1)
            .map(|l| opts[l][1].1)
            .sum();
        u + st + h + if pick.contains(&1) { merge } else { 0 } <= room.room
    }) else {
        return Ok(units);
    };
    let mut out = units;
    let mut seconds = rows as f64 / out.predicted_tokens_per_s;
    let (mut hbm, mut cpu) = (out.per_token.hbm_bytes, out.per_token.cpu_bytes);
    let mut cpu_reads = out.per_token.cpu_reads;
    let mut pcie = out.per_token.pcie_bytes;
    let mut hot_neurons = vec![None; n_layers];
    let mut hybrid_bytes = merge;
    for l in (0..n_layers).filter(|&l| pick[l] == 1) {
        let (u, h) = (&mut out.layers[l], &hot.layers[l]);
        seconds += opts[l][1].0 - u.seconds;
        // The hybrid layer's FFN: its hot neurons on the device (its device bytes count the
        // attention too), its cold ones on the CPU, the input down and the partial sum up.
        let ffn = [
            h.device_bytes.saturating_sub(room.attention_layers[l]),
            h.cpu_bytes,
            (rows * 2 * spec.d_model * 4) as u64,
        ];
        hbm = hbm - u.ffn_bytes[0] + ffn[0];
        cpu = cpu - u.ffn_bytes[1] + ffn[1];
        cpu_reads += h.cpu_reads;
        pcie = pcie - u.ffn_bytes[2] + ffn[2];
        hybrid_bytes += opts[l][1].1;
        hot_neurons[l] = Some(hot.hot_neurons[l].clone());
        *u = UnitLayer {
            mode: UnitMode::Hybrid,
            slots: [0; 3],
            hot: hot.hot_neurons[l].len(),
            device_bytes: opts[l][1].1,
            seconds: opts[l][1].0,
            ffn_bytes: ffn,
            attention_streamed: u.attention_streamed,
            mean_active: u.mean_active,
            expected_loads: 0.0,
            expected_in_place: 0.0,
        };
    }
    let (units_b, staging) = unit_device_bytes(&out.slots(), row, biased);
    let d = &mut out.device;
    d.units = units_b;
    d.staging = staging;
    d.hybrid = hybrid_bytes;
    d.placed = room.everything_else + units_b + staging + hybrid_bytes;
    d.total = g.fixed + d.placed;
    out.per_token = SparsePerToken {
        hbm_bytes: hbm,
        cpu_bytes: cpu,
        cpu_reads,
        pcie_bytes: pcie,
    };
    out.predicted_tokens_per_s = rows as f64 / seconds;
    out.hybrid = Some(HybridLayers {
        hot_neurons,
        cold_cost: hot.cold_cost.clone(),
        batch: hot.batch,
    });
    Ok(out)
}

/// Per layer, the faster of its two options `opts[l]` (seconds, device bytes), as far as
/// `fits` allows: where the faster choices do not fit, layers go back to their smaller choice,
/// least time lost per byte first. `None` where no layer takes its second option.
fn pick_modes(opts: &[[(f64, u64); 2]], fits: impl Fn(&[usize]) -> bool) -> Option<Vec<usize>> {
    let n_layers = opts.len();
    let mut pick: Vec<usize> = opts.iter().map(|o| usize::from(o[1].0 < o[0].0)).collect();
    while !fits(&pick) {
        let back = (0..n_layers)
            .filter(|&l| opts[l][pick[l]].1 > opts[l][1 - pick[l]].1)
            .min_by(|&a, &b| {
                let cost = |l: usize| {
                    (opts[l][1 - pick[l]].0 - opts[l][pick[l]].0)
                        / (opts[l][pick[l]].1 - opts[l][1 - pick[l]].1) as f64
                };
                cost(a).total_cmp(&cost(b))
            });
        let l = back?;
        pick[l] = 1 - pick[l];
    }
    pick.contains(&1).then_some(pick)
}

/// Cache units beside streamed attention, for a budget whose every layer's attention does not
/// fit beside units of one slot: the streaming plan with the FFN off the device and a reserve
/// kept free for the units and their staging (`Budget::unit_reserve`), attention resident by
/// rows as far as the rest allows and streamed through the window's slots beyond. The reserve
/// trades attention's copies for the units' own: from the least that holds units of one slot
/// (and one step's buffers free) up to every attention row streamed, in eighths, the fastest
/// by the plan's prediction at the fastest of `precisions`; where `mix`, each layer hybrid
/// instead where that is faster ([`mix_with_hybrid`], the hot neurons placed in the same
/// reserve). Refused with the least budget that holds units of one slot beside one streaming
/// slot where none fits.
#[allow(clippy::too_many_arguments)]
pub fn plan_units_streamed(
    m: &Manifest,
    budget: &Budget,
    hw: &HardwareProfile,
    profile: &SparsityProfile,
    target: f64,
    precisions: &[Precision],
    mix: bool,
) -> Result<UnitPlan, PlanError> {
    let with_reserve = |reserve: u64| {
        make_plan(
            m,
            &Budget {
                unit_reserve: Some(reserve),
                hot_reserve: None,
                cpu_split: false,
                ..budget.clone()
            },
            hw,
        )
    };
    let (row, biased) = neuron_rows(m);
    let n_layers = m.spec.n_layers;
    // The least reserve: units of one slot at the precision that takes fewest bytes.
    let least = precisions
        .iter()
        .map(|p| {
            let one = vec![[0, 1, 2].map(|i| usize::from(p.0[i] > 0)); n_layers];
            let (u, st) = unit_device_bytes(&one, row, biased);
            u + st
        })
        .min()
        .ok_or_else(|| PlanError::Budget("no neuron precision to plan for".into()))?;
    // Refused here with the least budget that runs: units of one slot, one streaming slot.
    let open = with_reserve(least)?;
    let mut refused = None;
    let precisions: Vec<Precision> = precisions
        .iter()
        .copied()
        .filter(|&p| match check_units(m, &open, Some(profile), p) {
            Ok(()) => true,
            Err(e) => {
                refused.get_or_insert(e);
                false
            }
        })
        .collect();
    if let Some(e) = refused.filter(|_| precisions.is_empty()) {
        return Err(e);
    }
    // What a larger reserve takes from: the attention rows resident beside the least one,
    // the bytes it leaves free, and the step's buffers (a smaller prefill step).
    let g = &open.gpu;
    let spare =
        g.resident_layers + g.scratch + budget.gpu_mem.saturating_sub(g.total + g.scratch + least);
    let reserves = (0..=8u64)
        .take_while(|&eighth| eighth == 0 || spare > 0)
        .map(|eighth| least + spare * eighth / 8);
    let planned = reserves.map(|reserve| {
        let base = with_reserve(reserve)?;
        // Hybrid layers' hot neurons placed in the same reserve.
        let hot = mix
            .then(|| plan_hot_streamed(m, budget, hw, profile, target, reserve).ok())
            .flatten();
        let room = streamed_room(m, base.clone())?;
        let units = precisions.iter().filter_map(|&p| {
            let u = plan_units_in(m, &base, room.clone(), Some(profile), target, p).ok()?;
            Some(Ok(match &hot {
                Some(h) => mix_with_hybrid(m, &base, u.clone(), h).unwrap_or(u),
                None => u,
            }))
        });
        fastest_of(units, || {
            PlanError::Budget(format!(
                "no cache units fit the {} kept for them",
                human_bytes(reserve)
            ))
        })
    });
    fastest_of(planned, || PlanError::Budget("no reserve to plan".into()))
}

/// The fastest of `plans` by predicted tokens/s; where none planned, the first refusal, else
/// `none`.
fn fastest_of(
    plans: impl IntoIterator<Item = Result<UnitPlan, PlanError>>,
    none: impl FnOnce() -> PlanError,
) -> Result<UnitPlan, PlanError> {
    let mut best: Option<UnitPlan> = None;
    let mut first_err = None;
    for planned in plans {
        match planned {
            Ok(u)
                if best
                    .as_ref()
                    .is_none_or(|b| u.predicted_tokens_per_s > b.predicted_tokens_per_s) =>
            {
                best = Some(u)
            }
            Ok(_) => {}
            Err(e) => {
                first_err.get_or_insert(e);
            }
        }
    }
    best.ok_or_else(|| first_err.unwrap_or_else(none))
}
