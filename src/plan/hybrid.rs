//! Hot-neuron placement for a profiled model (PowerInfer §6) and the plan of hybrid execution:
//! everything but the FFN stays on the device (every layer's attention, the output head, KV,
//! step memory: [`super::resident`]), what the budget leaves holds the FFN neurons that fire
//! most often, chosen by the exact ILP ([`super::placement`]) from the profile's activation
//! frequencies, and the CPU computes the other (cold) neurons from DRAM ([`super::cold`]). What
//! `plan --hot-neurons` prints and [`crate::tier::hybrid::HybridWeights`] runs: its device bytes
//! are counted here the way the source allocates them, buffer by buffer. Where every layer's
//! attention does not fit, [`plan_hot_streamed`] streams it beside the hot neurons instead (the
//! streaming source runs it).
//!
//! A block-quantized FFN keeps its matrices, and a neuron's share of the down matrix is a column
//! inside blocks of 32 (or 256) neurons: such layers place whole blocks ("units"), so the hot
//! and cold down matrices are whole blocks gathered row by row. Bundled FFNs place neurons.
//!
//! Fails where the profile is not the model's, the placement is not whole blocks, or the ILP's
//! table would be too fine ([`super::placement::PlacementError`]).

use serde::Serialize;

use crate::sparsity::{SparsityProfile, grid_index, grid_target};
use crate::store::Manifest;

use super::Plan;
use super::batch;
use super::budget::{Budget, PlanError, human_bytes};
use super::cold::{ColdCost, FfnLayout, PredictorCost, hot_rounding};
use super::cost::{HostKv, split_trip_bytes};
use super::hardware::HardwareProfile;
use super::placement::{PlacementLayer, min_gpu_neurons, place_hot_neurons};
use super::resident::{Base, BaseFor, SparsePerToken, base_of, layers_of};
use super::stream::make_plan;
use crate::backend::cpu::sparse::TILE_NEURONS;

/// One layer's share of the placement.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct HotLayer {
    pub neurons: usize,
    /// Share of the layer's activations (at the target) its GPU neurons account for.
    pub activation_share: f64,
    /// Where the layer's FFN runs: all on the GPU, all on the CPU, or split between them.
    pub runs: LayerRuns,
    /// Expected bytes per token the device reads for the layer (attention and hot neurons).
    pub device_bytes: u64,
    /// Expected bytes per token the CPU reads for its cold neurons.
    pub cpu_bytes: u64,
    /// The reads they come in (`FfnLayout::cold_reads`).
    pub cpu_reads: f64,
    /// Predicted seconds per token of the device's FFN share and the CPU's (with its round
    /// trip); the layer takes the longer, or on the budgeted device their sum
    /// (`HardwareProfile::together_s`).
    pub gpu_s: f64,
    pub cpu_s: f64,
}

/// Where a hybrid layer's FFN runs (the ILP's choice for it).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LayerRuns {
    Gpu,
    Hybrid,
    Cpu,
}

impl LayerRuns {
    /// A layer with `hot` neurons on the device and `cold` on the CPU.
    fn of(hot: usize, cold: usize) -> Self {
        match (hot, cold) {
            (_, 0) => LayerRuns::Gpu,
            (0, _) => LayerRuns::Cpu,
            _ => LayerRuns::Hybrid,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            LayerRuns::Gpu => "GPU",
            LayerRuns::Hybrid => "hybrid",
            LayerRuns::Cpu => "CPU",
        }
    }
}

/// Device bytes of hybrid execution, as the source allocates them (each buffer rounded).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct HybridDevice {
    /// Every layer's attention matrices, whole.
    pub attention: u64,
    /// The hot neurons' tensors.
    pub hot: u64,
    /// The buffer the CPU's partial sums come back into.
    pub merge: u64,
    /// Everything the byte ledger holds at the peak (small fragments, head, KV, step memory
    /// and the above).
    pub placed: u64,
    /// `fixed + placed`.
    pub total: u64,
}

#[derive(Clone, Debug, Serialize)]
pub struct HybridPlan {
    /// The profile's grid target the frequencies are taken at.
    pub target: f64,
    /// Device bytes left for FFN neurons once everything else is resident.
    pub budget_bytes: u64,
    pub bytes_per_neuron: u64,
    /// Fewest neurons worth a layer's GPU share (C_l).
    pub min_neurons: usize,
    pub layers: Vec<HotLayer>,
    pub bytes: u64,
    /// Share of all FFN activations computed on the GPU.
    pub activation_share: f64,
    pub solve_seconds: f64,
    /// Per layer, the ids of the hot neurons, ascending.
    #[serde(skip)]
    pub hot_neurons: Vec<Vec<u32>>,
    /// Per layer, what its cold neurons cost the CPU.
    pub cold_cost: Vec<ColdCost>,
    pub device: HybridDevice,
    /// DRAM the cold neurons take (gathered, per layer).
    pub dram_cold_bytes: u64,
    /// Start-up staging buffer (loading the attention matrices and the head).
    pub staging: u64,
    /// Rows of the merge buffer (the most tokens a step evaluates).
    pub batch: usize,
    /// Sequences a decode step evaluates a token of: the layers' seconds and bytes and
    /// `per_token` are of one such step (of one token where a sequence decodes alone), the
    /// prediction their aggregate tokens/s.
    pub sequences: usize,
    pub per_token: SparsePerToken,
    pub predicted_tokens_per_s: f64,
    /// Per layer, the predictor that names each step's neurons and what it costs
    /// (`--sparsity predicted`; none with the threshold's mask).
    pub predictors: Option<Vec<PredictorCost>>,
    /// With streamed attention: the streaming plan it runs on (attention residency, slots,
    /// the reserve), where the hot neurons go into the reserve.
    #[serde(skip)]
    pub base_plan: Option<Box<Plan>>,
}

/// The placement for `plan`'s budget and hardware from `profile` at `target` sparsity, and what
/// hybrid execution of it holds and moves.
pub fn plan_hot_neurons(
    m: &Manifest,
    plan: &Plan,
    profile: &SparsityProfile,
    target: f64,
) -> Result<HybridPlan, PlanError> {
    let k = grid_index(target);
    let spec = &plan.spec;
    let (d_ff, n_layers) = (spec.d_ff, spec.n_layers);
    if profile.d_ff != d_ff || profile.n_layers != n_layers {
        return Err(PlanError::Store(
            "the sparsity profile's shape is not this model's".into(),
        ));
    }
    let (base, layouts) = base_of(m, plan, BaseFor::Hybrid)?;
    place_in(plan, base, &layouts, profile, k)
}

/// The ILP's placement into what `base` leaves, and the plan of it.
fn place_in(
    plan: &Plan,
    base: Base,
    layouts: &[FfnLayout],
    profile: &SparsityProfile,
    k: usize,
) -> Result<HybridPlan, PlanError> {
    let spec = &plan.spec;
    let n_layers = spec.n_layers;
    let budget_bytes = base.budget_bytes;

    // C_l: a unit costs its bytes at DRAM speed on the CPU and at HBM speed on the GPU; a layer
    // split between them pays a round trip (the input down, the partial sum up). A layer wholly
    // on the GPU pays none, so it is always allowed (C_l at most the layer).
    let hw = &plan.hardware;
    let vector = (spec.d_model * 4) as f64;
    let sync = 2.0 * (hw.op_overhead_s + vector / hw.h2d_pinned_bytes_per_s);
    let freqs: Vec<Vec<f64>> = (0..n_layers).map(|l| profile.frequencies(l, k)).collect();
    let units: Vec<Vec<f64>> = freqs
        .iter()
        .zip(layouts)
        .map(|(f, lay)| {
            f.chunks(lay.cost.unit)
                .map(|c| c.iter().sum::<f64>())
                .collect()
        })
        .collect();
    let placement_layers: Vec<PlacementLayer> = units
        .iter()
        .zip(layouts)
        .map(|(impacts, lay)| PlacementLayer {
            impacts: impacts.clone(),
            bytes_per_neuron: lay.unit_bytes,
            // A unit at its bytes alone on either side, not the CPU's read starts: where the
            // device's memory is the CPU's (the budgeted device) no split then pays and each
            // layer stays whole, its down sum in the one order of blocks of ids. A split layer
            // adds the device's sum and the CPU's: a reassociation SmolLM2 bundled amplifies from
            // an ulp at layer 0 to 1.4e-2 of the logit scale (`tests/mode_parity.rs`).
            min_neurons: min_gpu_neurons(
                lay.unit_bytes as f64 / hw.dram_read_bytes_per_s,
                lay.unit_bytes as f64 / hw.hbm_bytes_per_s,
                sync,
                impacts.len(),
            )
            .min(impacts.len()),
        })
        .collect();
    let t0 = std::time::Instant::now();
    let placed = place_hot_neurons(&placement_layers, budget_bytes)
        .map_err(|e| PlanError::Budget(format!("hot-neuron placement: {e}")))?;
    let solve_seconds = t0.elapsed().as_secs_f64();

    let hot_neurons: Vec<Vec<u32>> = placed
        .neurons
        .iter()
        .zip(layouts)
        .map(|(us, lay)| {
            let u = lay.cost.unit as u32;
            us.iter().flat_map(|&j| j * u..(j + 1) * u).collect()
        })
        .collect();
    let min_neurons = placement_layers
        .iter()
        .zip(layouts)
        .map(|(p, l)| p.min_neurons * l.cost.unit)
        .max()
        .unwrap_or(0);
    Ok(finish(
        plan,
        &base,
        layouts,
        (&freqs, predictors_for(plan, Some(profile)).as_deref()),
        hot_neurons,
        Solved {
            target: grid_target(k),
            budget_bytes,
            min_neurons,
            bytes: placed.bytes,
            solve_seconds,
        },
    ))
}

/// Hybrid execution for a budget that cannot hold every layer's attention: the
/// streaming plan with the whole FFN off the device and `reserve` bytes kept free, in which the
/// ILP places the hot neurons; attention is resident as far as it fits and streams beyond.
pub fn plan_hot_streamed(
    m: &Manifest,
    budget: &Budget,
    hw: &HardwareProfile,
    profile: &SparsityProfile,
    target: f64,
    reserve: u64,
) -> Result<HybridPlan, PlanError> {
    let plan = make_plan(
        m,
        &Budget {
            hot_reserve: Some(reserve),
            cpu_split: false,
            ..budget.clone()
        },
        hw,
    )?;
    let spec = &plan.spec;
    if profile.d_ff != spec.d_ff || profile.n_layers != spec.n_layers {
        return Err(PlanError::Store(
            "the sparsity profile's shape is not this model's".into(),
        ));
    }
    if !plan.residency.ffn_off {
        return Err(PlanError::Budget(
            "the budget holds every layer: hybrid execution keeps attention resident".into(),
        ));
    }
    let (layouts, attention_layers) = layers_of(m, spec.n_layers)?;
    let g = &plan.gpu;
    let base = Base {
        attention: g.resident_layers + g.slots,
        attention_layers,
        staging: plan.dram.staging,
        merge: g.merge,
        everything_else: g.placed,
        budget_bytes: reserve.saturating_sub(hot_rounding(&layouts)),
        // What the slots bring per token: the plan's host→device bytes less the token's input
        // row and the split's partial sums, which hybrid's own figure counts.
        streamed: plan.per_token.h2d_bytes
            - spec.d_model as u64 * 4
            - split_trip_bytes(spec, plan.residency.cpu_bytes(&plan.shape)),
    };
    let k = grid_index(target);
    let hot = place_in(&plan, base, &layouts, profile, k)?;
    Ok(HybridPlan {
        base_plan: Some(Box::new(plan)),
        ..hot
    })
}

/// Hybrid execution of a placement given neuron by neuron (`hot[l]`: layer l's hot neuron ids,
/// ascending, whole units): what it holds and moves, its bytes checked against the budget.
/// Frequencies from `profile` at `target` if given, else every neuron at `target`.
pub fn plan_hybrid_with(
    m: &Manifest,
    plan: &Plan,
    hot: Vec<Vec<u32>>,
    profile: Option<&SparsityProfile>,
    target: f64,
) -> Result<HybridPlan, PlanError> {
    let k = grid_index(target);
    let (n_layers, d_ff) = (plan.spec.n_layers, plan.spec.d_ff);
    let (base, layouts) = base_of(m, plan, BaseFor::Hybrid)?;
    if hot.len() != n_layers {
        return Err(PlanError::Budget(format!(
            "a placement of {} layers for {n_layers}",
            hot.len()
        )));
    }
    for (l, (ids, lay)) in hot.iter().zip(&layouts).enumerate() {
        let u = lay.cost.unit;
        let whole = ids.len().is_multiple_of(u)
            && ids.windows(2).all(|w| w[0] < w[1])
            && ids.last().is_none_or(|&i| (i as usize) < d_ff)
            && ids.chunks(u).all(|c| {
                (c[0] as usize).is_multiple_of(u) && c.windows(2).all(|w| w[1] == w[0] + 1)
            });
        if !whole {
            return Err(PlanError::Budget(format!(
                "layer {l}: hot neurons must be ascending ids below {d_ff} in whole blocks of {u}"
            )));
        }
    }
    let freqs: Vec<Vec<f64>> = match profile {
        Some(p) => (0..n_layers).map(|l| p.frequencies(l, k)).collect(),
        None => vec![vec![1.0 - target; d_ff]; n_layers],
    };
    let bytes = hot
        .iter()
        .zip(&layouts)
        .map(|(ids, lay)| (ids.len() / lay.cost.unit) as u64 * lay.unit_bytes)
        .sum();
    let h = finish(
        plan,
        &base,
        &layouts,
        (&freqs, predictors_for(plan, profile).as_deref()),
        hot,
        Solved {
            target,
            budget_bytes: base.budget_bytes,
            min_neurons: 0,
            bytes,
            solve_seconds: 0.0,
        },
    );
    if h.device.total > plan.budget.gpu_mem {
        return Err(PlanError::GpuTooSmall {
            budget: plan.budget.gpu_mem,
            minimum: h.device.total,
            breakdown: format!(
                "hot neurons {} on top of attention {}",
                human_bytes(h.device.hot),
                human_bytes(h.device.attention)
            ),
        });
    }
    Ok(h)
}

/// What the ILP (or a caller) decided.
struct Solved {
    target: f64,
    budget_bytes: u64,
    min_neurons: usize,
    bytes: u64,
    solve_seconds: f64,
}

/// Every layer's predictor cost where the plan's budget runs them (`--sparsity predicted`) and
/// the profile has them.
pub(super) fn predictors_for(
    plan: &Plan,
    profile: Option<&SparsityProfile>,
) -> Option<Vec<PredictorCost>> {
    profile
        .filter(|_| plan.budget.predicted)
        .and_then(PredictorCost::all)
}

/// A layer's expected cold work in a decode step.
struct ColdWork {
    /// FLOPs per row of the step: the deciding vector of every cold neuron examined (every one,
    /// or those its predictor names), the rest of those some row needs (computed for every
    /// row), the predictor's products where it runs.
    flops: f64,
    /// Expected bytes the CPU reads.
    bytes: f64,
    /// Expected reads they come in (`FfnLayout::cold_reads`).
    reads: f64,
    /// DRAM its cold neurons take, gathered (tiles hold whole fours: the last one padded).
    dram: u64,
    /// Whether the layer's cold neurons are laid out in tiles (`ColdCost::tiled`).
    tiled: bool,
}

/// The cold work of a layer with frequencies `f` and `hot` neurons on the device, in a step of
/// `rows` sequences: every cold neuron examined, each needed where active for some row (with its
/// frequency, rows and neurons taken as independent), a down block touched unless all its
/// neurons are off for every row. With a `predictor` the neurons it names for some row are
/// examined and computed (named with [`PredictorCost::names`]), and its weights read. A
/// neuron's deciding vector and the whole neuron take `(decide, neuron)` FLOPs.
fn cold_work(
    f: &[f64],
    hot: &[u32],
    lay: &FfnLayout,
    rows: usize,
    predictor: Option<&PredictorCost>,
    (decide, neuron): (f64, f64),
) -> ColdWork {
    let mut is_hot = vec![false; f.len()];
    hot.iter().for_each(|&j| is_hot[j as usize] = true);
    let cold: Vec<usize> = (0..f.len()).filter(|&j| !is_hot[j]).collect();
    let needed = |p: f64| match predictor {
        Some(pc) => pc.names(p),
        None => p,
    };
    let active: f64 = cold
        .iter()
        .map(|&j| batch::union_share(needed(f[j]), rows))
        .sum();
    // The chance some row needs one of a set of neurons (frequencies `ps`).
    let any_needed = |ps: &mut dyn Iterator<Item = f64>| {
        let none = ps.map(|p| 1.0 - needed(p)).product::<f64>();
        1.0 - if rows > 1 {
            none.powi(rows as i32)
        } else {
            none
        }
    };
    let touched: f64 = f
        .chunks(lay.cost.unit)
        .enumerate()
        .filter(|(u, _)| !is_hot[u * lay.cost.unit])
        .map(|(_, c)| any_needed(&mut c.iter().copied()))
        .sum();
    let examined = match predictor {
        Some(_) => active,
        None => cold.len() as f64,
    };
    let c = lay.cost;
    let needed_bytes = c.decide_bytes as f64 * examined
        + c.active_bytes as f64 * active
        + c.unit_bytes as f64 * touched;
    // In tiles (every cold neuron examined: no predictor), each tile read whole where one of
    // its neurons is on for some row.
    let tile_on = cold
        .chunks(TILE_NEURONS)
        .map(|t| any_needed(&mut t.iter().map(|&j| f[j])));
    let tiled = predictor.is_none() && lay.tiles_pay(tile_on, needed_bytes);
    ColdWork {
        flops: decide * examined + (neuron - decide) * active + predictor.map_or(0.0, |p| p.flops),
        bytes: needed_bytes + predictor.map_or(0.0, |p| p.weight_bytes as f64),
        reads: if tiled {
            cold.len().div_ceil(TILE_NEURONS) as f64
        } else {
            lay.cold_reads((examined, predictor.is_none()), active, touched)
        },
        dram: if tiled {
            cold.len().next_multiple_of(TILE_NEURONS)
        } else {
            cold.len()
        } as u64
            / c.unit as u64
            * lay.unit_bytes,
        tiled,
    }
}

/// The bytes the device reads of a layer's `hot` neurons (frequencies `f`) in a step of `rows`
/// sequences: over bundles with a `predictor`, only those it names for some row (the
/// neuron-listed kernels), else all of them.
fn hot_read(
    f: &[f64],
    hot: &[u32],
    lay: &FfnLayout,
    rows: usize,
    predictor: Option<&PredictorCost>,
) -> u64 {
    match predictor {
        Some(pc) if lay.reads_listed() => {
            let named: f64 = hot
                .iter()
                .map(|&j| batch::union_share(pc.names(f[j as usize]), rows))
                .sum();
            (named * lay.unit_bytes as f64) as u64
        }
        _ => (hot.len() / lay.cost.unit) as u64 * lay.unit_bytes,
    }
}

/// The plan of a placement: device bytes, cold costs, expected traffic and speed.
fn finish(
    plan: &Plan,
    base: &Base,
    layouts: &[FfnLayout],
    (freqs, predictors): (&[Vec<f64>], Option<&[PredictorCost]>),
    hot_neurons: Vec<Vec<u32>>,
    solved: Solved,
) -> HybridPlan {
    let spec = &plan.spec;
    let (d_ff, n_layers) = (spec.d_ff, spec.n_layers);
    let hw = &plan.hardware;
    let g = &plan.gpu;
    // A decode step of `rows` sequences: weights read once, every row computed; the cold
    // neurons any of them needs read and computed for all ([`super::batch`]).
    let rows = batch::step_rows(&plan.budget, &plan.prefill);
    let r = rows as u64;
    let (cpu_rate, device_rate) = (batch::cpu_flops_per_s(hw), hw.matmul_flops_per_s);
    let vector = (rows * spec.d_model * 4) as f64;
    let sync = 2.0 * (hw.op_overhead_s + vector / hw.h2d_pinned_bytes_per_s);
    let attention_row =
        batch::projection_flops(spec) + batch::attention_flops(spec, plan.budget.ctx / 2);
    let neuron_flops = (2.0 * spec.d_model as f64, batch::neuron_flops(spec));
    let total: f64 = freqs.iter().flatten().sum();
    let mut layers = Vec::with_capacity(n_layers);
    let mut hot_device = 0;
    let mut hbm = g.small + g.head + base.attention_layers.iter().sum::<u64>();
    let mut cpu = 0u64;
    let mut cold_dram = 0u64;
    let mut cold_cost = Vec::with_capacity(n_layers);
    let mut seconds = 0.0;
    let mut on_total = 0.0;
    for (l, ((ids, f), lay)) in hot_neurons.iter().zip(freqs).zip(layouts).enumerate() {
        let layer_total: f64 = f.iter().sum();
        // (+ 0.0: an empty float sum is -0.0.)
        let on: f64 = ids.iter().map(|&j| f[j as usize]).sum::<f64>() + 0.0;
        on_total += on;
        hot_device += lay.device_bytes(ids.len());
        let predictor = predictors.and_then(|p| p.get(l));
        let hot_raw = hot_read(f, ids, lay, rows, predictor);
        hbm += hot_raw;
        let work = cold_work(f, ids, lay, rows, predictor, neuron_flops);
        cold_dram += work.dram;
        cold_cost.push(ColdCost {
            tiled: work.tiled,
            ..lay.cost
        });
        let cold = d_ff - ids.len();
        cpu += work.bytes as u64;
        let layer_attention = base.attention_layers[l];
        let gpu_s = batch::bounded(
            hot_raw as f64,
            hw.hbm_bytes_per_s,
            rows,
            ids.len() as f64 * batch::neuron_flops(spec),
            device_rate,
        );
        let cpu_s = if cold == 0 && predictor.is_none() {
            0.0
        } else {
            batch::bounded_read(
                hw.cpu_sparse_seconds(work.bytes, work.reads),
                rows,
                work.flops,
                cpu_rate,
            ) + sync
        };
        let attention_s = batch::bounded(
            layer_attention as f64,
            hw.hbm_bytes_per_s,
            rows,
            attention_row,
            device_rate,
        );
        // The device's share beside the CPU's, or in turn on the budgeted device (its hot
        // neurons, then the cold ones, took 0.5 and 8.3 ms of SmolLM2's step at 48M).
        seconds += attention_s + hw.together_s(gpu_s, cpu_s);
        layers.push(HotLayer {
            neurons: ids.len(),
            activation_share: if layer_total > 0.0 {
                on / layer_total
            } else {
                0.0
            },
            runs: LayerRuns::of(ids.len(), cold),
            device_bytes: layer_attention + hot_raw,
            cpu_bytes: work.bytes as u64,
            cpu_reads: work.reads,
            gpu_s,
            cpu_s,
        });
    }
    // A host-kept KV cache the CPU attends (one the link brings in is in `base.streamed`).
    let kv = HostKv::of(plan, rows);
    (cpu, seconds) = (cpu + kv.cpu, seconds + kv.cpu_s);
    let per_session = g.kv / plan.budget.sessions.max(1) as u64;
    hbm += r * per_session / 2;
    seconds += batch::bounded(
        (g.head + r * per_session / 2) as f64,
        hw.hbm_bytes_per_s,
        rows,
        batch::head_flops(spec),
        device_rate,
    );
    // About 16 ops a layer (norms, projections, rope, attention, FFN, merge, adds).
    seconds += (n_layers * 16 + 4) as f64 * hw.op_overhead_s;
    // Per row and layer the FFN input down and the partial sum up; the token's row; logits.
    let vectors = ((2 * n_layers + 1) * spec.d_model + spec.vocab_size) as u64 * 4;
    let pcie = r * vectors + base.streamed;
    // Streamed attention comes in beside the compute, or in turn on the budgeted device.
    let seconds = hw.together_s(seconds, base.streamed as f64 / hw.h2d_pinned_bytes_per_s);
    let placed_bytes = base.everything_else + hot_device;
    let cpu_reads = layers.iter().map(|l| l.cpu_reads).sum();
    let bytes_per_neuron = layouts
        .iter()
        .map(|l| l.unit_bytes / l.cost.unit as u64)
        .max()
        .unwrap_or(0);
    HybridPlan {
        target: solved.target,
        budget_bytes: solved.budget_bytes,
        bytes_per_neuron,
        min_neurons: solved.min_neurons,
        layers,
        bytes: solved.bytes,
        activation_share: if total > 0.0 { on_total / total } else { 0.0 },
        solve_seconds: solved.solve_seconds,
        hot_neurons,
        cold_cost,
        device: HybridDevice {
            attention: base.attention,
            hot: hot_device,
            merge: base.merge,
            placed: placed_bytes,
            total: g.fixed + placed_bytes,
        },
        dram_cold_bytes: cold_dram,
        staging: base.staging,
        batch: plan.budget.batch,
        sequences: rows,
        per_token: SparsePerToken {
            hbm_bytes: hbm,
            cpu_bytes: cpu,
            cpu_reads,
            pcie_bytes: pcie,
        },
        predicted_tokens_per_s: rows as f64 / seconds,
        predictors: predictors.map(<[PredictorCost]>::to_vec),
        base_plan: None,
    }
}

/// The report's line on the predictors of a sparse plan, if it runs them.
pub(super) fn predictors_line(predictors: Option<&[PredictorCost]>) -> Option<String> {
    let (weight_bytes, share, recall) = PredictorCost::summary(predictors?)?;
    Some(format!(
        "predictors (--sparsity predicted): {} of weights read by the host per step, {:.1}% of the neurons named on average, recall {recall:.3} on the profile's held-out tokens",
        human_bytes(weight_bytes),
        100.0 * share,
    ))
}

/// What a sparse plan's per-token figures are of: a token, or a step of several sequences.
pub(super) fn step_of(sequences: usize) -> String {
    if sequences > 1 {
        format!("step of {sequences} sequences")
    } else {
        "token".into()
    }
}

impl HybridPlan {
    pub fn report(&self) -> String {
        use std::fmt::Write;
        let mut s = String::new();
        let h = human_bytes;
        let _ = writeln!(
            s,
            "hot neurons at {:.0}% sparsity: {} left for FFN neurons after attention, head, KV and step memory; {} per neuron, at least {} per layer (C_l)",
            self.target * 100.0,
            h(self.budget_bytes),
            h(self.bytes_per_neuron),
            self.min_neurons
        );
        let _ = writeln!(
            s,
            "layer    runs  GPU neurons  share of its activations  device MiB/token  CPU MiB/token  GPU ms  CPU ms"
        );
        let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
        for (l, x) in self.layers.iter().enumerate() {
            let _ = writeln!(
                s,
                "{l:>5}  {:>6}  {:>11}  {:>23.1}%  {:>16.2}  {:>13.2}  {:>6.3}  {:>6.3}",
                x.runs.name(),
                x.neurons,
                100.0 * x.activation_share,
                mib(x.device_bytes),
                mib(x.cpu_bytes),
                x.gpu_s * 1e3,
                x.cpu_s * 1e3
            );
        }
        let _ = writeln!(
            s,
            "placed {} ({:.1}% of all FFN activations on the GPU), exact ILP solved in {:.1} ms",
            h(self.bytes),
            100.0 * self.activation_share,
            self.solve_seconds * 1e3
        );
        let d = &self.device;
        let _ = writeln!(
            s,
            "hybrid (--cold cpu): device {} (attention {}, hot neurons {}, merge buffer {}), cold neurons in DRAM {}",
            h(d.total),
            h(d.attention),
            h(d.hot),
            h(d.merge),
            h(self.dram_cold_bytes)
        );
        if let Some(line) = predictors_line(self.predictors.as_deref()) {
            let _ = writeln!(s, "{line}");
        }
        let p = &self.per_token;
        let _ = writeln!(
            s,
            "per {}: device reads {}, CPU reads {} from DRAM in {:.0} reads, PCIe {}; predicted {}",
            step_of(self.sequences),
            h(p.hbm_bytes),
            h(p.cpu_bytes),
            p.cpu_reads,
            h(p.pcie_bytes),
            batch::speed(self.predicted_tokens_per_s, self.sequences)
        );
        s
    }
}
