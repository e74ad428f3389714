//! Offline decisions as data: where every byte of a stored model lives for a budget, and how fast
//! that should run. Pure data and math (no devices, no I/O besides reading profiles).
//!
//! A [`Plan`] combines:
//! - size-aware caching (HyperGen): the small fragments (norms, biases, the RoPE table) are
//!   always resident, smallest first;
//! - the output matrix resident (used every token; streaming it would need a slot its size);
//! - flexible tensor preservation with balanced locking (FlexInfer, [`preserve`](mod@preserve)): the same
//!   resident share of every layer, the rest streamed through `window` device slots;
//! - the DRAM two-level cache (M2Cache): the streamed parts of the first layers fixed in DRAM,
//!   the others cycling through a dynamic area refilled from SSD ahead of use;
//! - the cost model: bytes each tier moves per token, and the predicted tokens/s.
//!
//! Device bytes are counted as the devices take them: the process's fixed cost (context, modules,
//! cuBLAS; from the hardware profile or measured) comes off `--gpu-mem` first, every buffer is
//! rounded to the allocation granule ([`device_bytes`]), and a step's activations and workspace
//! come from the engine's and the CUDA backend's own formulas ([`step_memory`],
//! [`crate::footprint::workspace_bytes`]) — so what the plan accepts, the budgeted device and
//! the GPU both run.

pub mod hardware;
pub mod hybrid;
pub mod placement;
pub mod precision;
pub mod preserve;
mod report;
pub mod units;

use serde::Serialize;
use thiserror::Error;

use crate::backend::KvType;
use crate::footprint::{GOOD_GROUP, MAX_GROUP, device_bytes};
use crate::footprint::{
    MatmulShape, MatmulShapes, PrefillLayout, StepMemory, kv_bytes, kv_pool_bytes, kv_table_bytes,
    probe_bytes, step_memory,
};
use crate::model::{ModelSpec, PositionEncoding};
use crate::store::{Encoding, GROUP_ROWS, Manifest, Segment, SegmentKind, names};
use crate::tensor::DType;

pub use hardware::HardwareProfile;
pub use preserve::{LayerShape, PARTS, Part, Residency, preserve};

/// Upper bound on one staging read (resident weights are loaded in chunks of whole groups).
pub const STAGING_CHUNK_BYTES: u64 = 64 << 20;
/// Dynamic DRAM buffers when the DRAM budget cannot hold every streamed layer: the layer being
/// copied to the device, the one whose copy may still be in flight, and two read ahead.
pub const DYNAMIC_BUFFERS: usize = 4;

/// What the plan must fit in.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Budget {
    /// Device memory, bytes.
    pub gpu_mem: u64,
    /// Host memory for the model (tables, streamed layers, staging); `None` = unlimited.
    pub dram_mem: Option<u64>,
    /// Layers streamed ahead of compute (FlexInfer's prefetch window).
    pub window: usize,
    /// KV cache positions of each session.
    pub ctx: usize,
    /// Sessions holding a KV cache at once (`serve --parallel`).
    pub sessions: usize,
    /// A paged KV pool of this many blocks ([`crate::backend::KV_BLOCK`] positions each) shared
    /// by the sessions, in place of a cache of `ctx` positions per session (serve). Where only
    /// KV in host memory fits ([`PrefillLayout::kv_host`]), the sessions keep theirs there.
    #[serde(default)]
    pub kv_pool: Option<usize>,
    /// Element type of the KV cache on the device.
    pub kv_type: KvType,
    /// Whether each session keeps a query probe (serve's contexts measure attention density).
    pub probe: bool,
    /// Most tokens one forward step evaluates (prefill batch).
    pub batch: usize,
    /// Most tokens one forward call evaluates (the longest prompt): a call longer than the
    /// step the budget holds runs layer by layer in row groups ([`PrefillLayout`]), its hidden
    /// states kept on the device where this many rows fit.
    #[serde(default)]
    pub prompt: usize,
    /// Logit rows one step returns at most.
    pub logit_rows: usize,
    /// Most rows a prefill step may grow to where every layer stays on the device beside it
    /// (`--prefill-step`; at most [`MAX_GROUP`]).
    pub max_step: usize,
    /// Whether the planner may have the CPU compute some of the FFN neurons that do not fit
    /// (bundled FFNs): the CPU+PCIe split (`--cold split`).
    pub cpu_split: bool,
    /// Hybrid execution with streamed attention: the FFN off the device, its hot
    /// neurons to be placed in this many bytes kept free (see [`hot::plan_cold`]).
    pub hot_reserve: Option<u64>,
}

impl Budget {
    /// One session of `ctx` positions with an f16 KV cache, no probe.
    pub fn new(
        gpu_mem: u64,
        dram_mem: Option<u64>,
        window: usize,
        ctx: usize,
        batch: usize,
    ) -> Self {
        Budget {
            gpu_mem,
            dram_mem,
            window,
            ctx,
            sessions: 1,
            kv_pool: None,
            kv_type: KvType::F16,
            probe: false,
            batch,
            prompt: batch,
            logit_rows: 1,
            max_step: MAX_GROUP,
            cpu_split: false,
            hot_reserve: None,
        }
    }
}

#[derive(Debug, Error)]
pub enum PlanError {
    #[error(
        "--gpu-mem {} is too small to run this model: at least {} is needed ({})",
        human_bytes(*budget), human_bytes(*minimum), breakdown
    )]
    GpuTooSmall {
        budget: u64,
        minimum: u64,
        breakdown: String,
    },
    #[error(
        "--dram-mem {} is too small: at least {} of host memory is needed ({})",
        human_bytes(*budget), human_bytes(*minimum), breakdown
    )]
    DramTooSmall {
        budget: u64,
        minimum: u64,
        breakdown: String,
    },
    #[error("store: {0}")]
    Store(String),
    #[error("invalid budget: {0}")]
    Budget(String),
}

/// Device memory by use (as the device takes it: every buffer rounded to the granule).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct GpuBytes {
    /// What the process holds before placing anything (context, modules, cuBLAS).
    pub fixed: u64,
    pub small: u64,
    pub head: u64,
    pub resident_layers: u64,
    pub slots: u64,
    /// KV caches (and query probes) of every session.
    pub kv: u64,
    /// One step's activation and logits buffers.
    pub scratch: u64,
    /// One step's backend workspace.
    pub workspace: u64,
    /// Where the CPU's share of a split FFN comes back to (0 without a split).
    #[serde(default)]
    pub merge: u64,
    /// Everything but `fixed`: what the byte ledger holds at the peak.
    pub placed: u64,
    /// `fixed + placed`: the process's device memory at the peak.
    pub total: u64,
}

/// Host memory by use.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct DramPlan {
    /// Embedding (and position) tables, read one row per token.
    pub tables: u64,
    /// Buffer for loading resident weights at start-up (freed after).
    pub staging: u64,
    /// Bytes of one layer's streamed parts as read from SSD (whole pages).
    pub layer_bytes: u64,
    /// Layers whose streamed parts stay in DRAM (the first ones).
    pub fixed_layers: usize,
    /// Buffers of the dynamic area (0 when every layer is fixed).
    pub dynamic_buffers: usize,
    /// FFN neurons the CPU computes (the split), every layer, held for the whole run.
    #[serde(default)]
    pub cpu_rows: u64,
    /// Steady-state total.
    pub total: u64,
}

/// Bytes moved per decoded token.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PerToken {
    pub h2d_bytes: u64,
    pub d2h_bytes: u64,
    pub ssd_bytes: u64,
    /// Bytes device compute reads (weights, KV at mid context).
    pub hbm_read_bytes: u64,
    /// Bytes the CPU reads from DRAM for the FFN neurons it computes (the split).
    #[serde(default)]
    pub cpu_read_bytes: u64,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Prediction {
    pub tokens_per_s: f64,
    /// The resource that bounds decode.
    pub limited_by: String,
    pub pcie_s: f64,
    pub ssd_s: f64,
    pub hbm_s: f64,
    /// The CPU's share of a split FFN, with a round trip of the FFN input and partial sum per
    /// layer; serial with the device's compute.
    #[serde(default)]
    pub cpu_s: f64,
    pub ops_s: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct Plan {
    pub model_id: String,
    pub model: String,
    pub spec: ModelSpec,
    pub hardware: HardwareProfile,
    pub budget: Budget,
    pub shape: LayerShape,
    pub residency: Residency,
    /// Device slots streamed layers pass through (0 when all is resident).
    pub window: usize,
    pub resident_bytes_per_layer: u64,
    pub streamed_bytes_per_layer: u64,
    pub gpu: GpuBytes,
    pub dram: DramPlan,
    pub per_token: PerToken,
    pub prediction: Prediction,
    /// How a call longer than one step runs, and where the KV cache lives.
    pub prefill: PrefillLayout,
}

impl Plan {
    /// Whether anything streams.
    pub fn streams(&self) -> bool {
        self.streamed_bytes_per_layer > 0
    }

    /// The byte ledger's HBM budget: `--gpu-mem` less the fixed cost.
    pub fn ledger_budget(&self) -> u64 {
        self.budget.gpu_mem - self.gpu.fixed
    }

    /// The per-layer table and totals, for people.
    pub fn report(&self) -> String {
        report::render(self)
    }

    /// Host→device and device→host bytes of the token decoded at position `pos` (the
    /// per-token figures are at mid context): a KV cache in host memory comes back to the
    /// device for each layer, the `pos` rows before the token.
    pub fn decode_bytes_at(&self, pos: usize) -> (u64, u64) {
        let pt = &self.per_token;
        if !self.prefill.kv_host || self.prefill.cpu_attention {
            return (pt.h2d_bytes, pt.d2h_bytes);
        }
        let spec = &self.spec;
        let mid = kv_bytes(spec, self.budget.ctx, self.budget.kv_type) / 2;
        let rows = 2 * spec.n_layers as u64 * pos as u64;
        let at = rows * self.budget.kv_type.row_bytes(spec.kv_dim()) as u64;
        (pt.h2d_bytes - mid + at, pt.d2h_bytes)
    }

    /// Time to first token of a fresh prompt of `tokens` under this plan: the larger of the
    /// bytes it moves over PCIe ÷ the link rate and its FLOPs ÷ the device's rates (the
    /// products' at the matrix-product rate, attention's at the attention rate), plus the ops'
    /// fixed cost. A partitioned prompt streams each layer once (layer by layer),
    /// as a prompt of one step does; its hidden states cross PCIe twice per layer where they live
    /// in host memory, and its keys and values once where the cache does.
    pub fn prefill_prediction(&self, tokens: usize) -> PrefillPrediction {
        let spec = &self.spec;
        let hw = &self.hardware;
        let tokens = tokens.max(1);
        let l = spec.n_layers as u64;
        let t = tokens as u64;
        let d = spec.d_model as u64;
        let layout = self.prefill;
        let partitioned = layout.partitions(tokens);
        let groups = tokens.div_ceil(layout.group.max(1));
        let kv_in = if layout.kv_host && !layout.cpu_attention {
            kv_bytes(spec, self.budget.ctx, self.budget.kv_type) / 2
        } else {
            0
        };
        let weights = self
            .per_token
            .h2d_bytes
            .saturating_sub(kv_in + cpu_attention_rows(spec, layout).0 + d * 4);
        let hidden = if partitioned && !layout.residual_on_device(tokens) {
            2 * l * t * d * 4
        } else {
            0
        };
        let kv_out = if layout.kv_host {
            2 * l * t * self.budget.kv_type.row_bytes(spec.kv_dim()) as u64
        } else {
            0
        };
        let h2d = weights + hidden / 2 + t * d * 4;
        let d2h = hidden / 2 + kv_out + spec.vocab_size as u64 * 4;
        // Products: 2 FLOPs per weight per token, the head for the last token; attention
        // 2·2·q_dim per (query, key) pair, causal (half the square).
        let ffn_mats = if spec.gated_ffn { 3 } else { 2 };
        let per_layer = (spec.d_model * (2 * spec.q_dim() + 2 * spec.kv_dim())
            + ffn_mats * spec.d_model * spec.d_ff) as f64;
        let attention_flops = causal_attention_flops(tokens, 0, spec.q_dim()) * l as f64;
        let flops = 2.0 * tokens as f64 * per_layer * l as f64
            + attention_flops
            + 2.0 * (spec.d_model * spec.vocab_size) as f64;
        let pcie_s = h2d.max(d2h) as f64 / hw.h2d_pinned_bytes_per_s;
        // The products at the matrix-product rate, attention at its own where measured.
        let compute_s = (flops - attention_flops) / hw.matmul_flops_per_s
            + attention_flops / hw.attention_rate();
        let ops_s = (groups * spec.n_layers * 14 + 4) as f64 * hw.op_overhead_s;
        PrefillPrediction {
            tokens,
            groups,
            h2d_bytes: h2d,
            d2h_bytes: d2h,
            flops,
            attention_flops,
            pcie_s,
            compute_s,
            ops_s,
            ttft_s: pcie_s.max(compute_s) + ops_s,
            limited_by: if pcie_s >= compute_s {
                "PCIe"
            } else {
                "compute"
            }
            .into(),
        }
    }
}

/// FLOPs of causal attention for one layer: `rows` query rows at positions `context..`, each
/// scoring and summing (2 FLOPs a multiply-add, both products) every position up to its own,
/// over `q_dim` query columns (heads × head dim).
pub fn causal_attention_flops(rows: usize, context: usize, q_dim: usize) -> f64 {
    let (rows, context) = (rows as f64, context as f64);
    4.0 * q_dim as f64 * (rows * context + rows * (rows + 1.0) / 2.0)
}

/// Bytes a decoded token writes back per token where the KV cache lives in host memory: its key
/// and value rows of every layer.
fn kv_row_out(spec: &ModelSpec, budget: &Budget, prefill: PrefillLayout) -> u64 {
    if prefill.kv_host && !prefill.cpu_attention {
        2 * spec.n_layers as u64 * budget.kv_type.row_bytes(spec.kv_dim()) as u64
    } else {
        0
    }
}

/// (Host→device, device→host) bytes of a decoded token attending on the CPU: per layer the
/// attention output up; its query, key and value down.
fn cpu_attention_rows(spec: &ModelSpec, prefill: PrefillLayout) -> (u64, u64) {
    if !prefill.cpu_attention {
        return (0, 0);
    }
    let l = spec.n_layers as u64;
    let (q, kv) = (spec.q_dim() as u64 * 4, spec.kv_dim() as u64 * 4);
    (l * q, l * (q + 2 * kv))
}

/// [`Plan::prefill_prediction`]: a prompt's time to first token and what bounds it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PrefillPrediction {
    pub tokens: usize,
    /// Row groups per layer (1: the prompt is one step).
    pub groups: usize,
    pub h2d_bytes: u64,
    pub d2h_bytes: u64,
    /// Every FLOP of the prompt, and of them its causal attention's (at the profile's attention
    /// rate; the rest at the matrix-product rate).
    pub flops: f64,
    pub attention_flops: f64,
    pub pcie_s: f64,
    pub compute_s: f64,
    pub ops_s: f64,
    pub ttft_s: f64,
    pub limited_by: String,
}

/// Bytes in the largest binary unit that keeps a whole number in front (e.g. `300.0 KiB`,
/// `1.5 GiB`); rounded up, so a stated minimum is always enough.
pub fn human_bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut unit = 0;
    while unit + 1 < UNITS.len() && b >= 1u64 << (10 * (unit + 1)) {
        unit += 1;
    }
    if unit == 0 {
        return format!("{b} B");
    }
    let scale = (1u64 << (10 * unit)) as f64;
    format!(
        "{:.1} {}",
        (b as f64 / scale * 10.0).ceil() / 10.0,
        UNITS[unit]
    )
}

fn store_err(msg: String) -> PlanError {
    PlanError::Store(msg)
}

pub(crate) fn seg<'a>(m: &'a Manifest, name: &str) -> Result<&'a Segment, PlanError> {
    m.segment(name)
        .ok_or_else(|| store_err(format!("segment `{name}` is missing")))
}

/// The segment of part `p` in layer `l`.
pub fn part_segment_name(l: usize, p: Part) -> String {
    match p {
        Part::Ffn => names::bundles(l, Encoding::F16),
        Part::Gate => names::layer(l, "ffn_gate.weight"),
        Part::Up => names::layer(l, "ffn_up.weight"),
        Part::Down => names::layer(l, "ffn_down.weight"),
        Part::Q => names::layer(l, "attn_q.weight"),
        Part::K => names::layer(l, "attn_k.weight"),
        Part::V => names::layer(l, "attn_v.weight"),
        Part::O => names::layer(l, "attn_output.weight"),
    }
}

/// Whether the store holds part `p` (the FFN is bundles or matrices; a gate only when gated).
fn holds(m: &Manifest, p: Part) -> bool {
    let bundled = !m.bundle_encodings.is_empty();
    match p {
        Part::Ffn => bundled,
        Part::Gate => !bundled && m.spec.gated_ffn,
        Part::Up | Part::Down => !bundled,
        Part::Q | Part::K | Part::V | Part::O => true,
    }
}

/// Row shape of every layer's streamable parts (the parts the store does not hold have no
/// rows). Rows are the same in every layer; formats, and so row bytes, may differ (a Q4_K_M file
/// keeps some layers' `ffn_down` and `attn_v` in Q6_K).
pub fn layer_shapes(m: &Manifest) -> Result<Vec<LayerShape>, PlanError> {
    let mut shapes: Vec<LayerShape> = Vec::with_capacity(m.spec.n_layers);
    for l in 0..m.spec.n_layers {
        let mut shape = LayerShape {
            rows: [0; PARTS],
            row_bytes: [0; PARTS],
        };
        for p in Part::ALL.into_iter().filter(|&p| holds(m, p)) {
            let s = seg(m, &part_segment_name(l, p))?;
            shape.rows[p.index()] = s.rows;
            shape.row_bytes[p.index()] = s.row_bytes() as u64;
        }
        if let Some(first) = shapes.first()
            && first.rows != shape.rows
        {
            return Err(store_err(format!(
                "layer {l} has other tensor shapes than layer 0"
            )));
        }
        shapes.push(shape);
    }
    Ok(shapes)
}

/// The shape every layer fits: each part's widest rows over the layers (what a streaming slot
/// and a DRAM buffer are sized for).
pub fn layer_shape(m: &Manifest) -> Result<LayerShape, PlanError> {
    Ok(widest(&layer_shapes(m)?))
}

fn widest(shapes: &[LayerShape]) -> LayerShape {
    let mut w = shapes.first().copied().unwrap_or(LayerShape {
        rows: [0; PARTS],
        row_bytes: [0; PARTS],
    });
    for s in shapes {
        for (a, b) in w.row_bytes.iter_mut().zip(s.row_bytes) {
            *a = (*a).max(b);
        }
    }
    w
}

/// The format of part `p` in the layer where its rows are widest (what a slot for it is
/// allocated in, and re-typed from for each layer it holds).
pub fn widest_dtype(m: &Manifest, p: Part) -> Result<DType, PlanError> {
    let mut best = None;
    for l in 0..m.spec.n_layers {
        let s = seg(m, &part_segment_name(l, p))?;
        if best.is_none_or(|(rb, _)| s.row_bytes() > rb) {
            best = Some((s.row_bytes(), device_dtype(s)));
        }
    }
    best.map(|(_, d)| d)
        .ok_or_else(|| store_err(format!("no layer holds {}", p.name())))
}

/// Bytes of the small fragments the device holds (f32 vectors and the RoPE table), smallest
/// first (HyperGen's size-aware order; all of them are kept).
pub fn small_fragments(m: &Manifest) -> Vec<(String, u64)> {
    let mut v: Vec<(String, u64)> = m
        .segments
        .iter()
        .filter(|s| s.kind == SegmentKind::Tensor && s.rows == 1 && s.name != names::ROPE_FREQS)
        .map(|s| (s.name.clone(), s.bytes))
        .collect();
    if let PositionEncoding::Rope(r) = &m.spec.position {
        v.push(("rope.inv_freq".into(), (r.dims / 2 * 4) as u64));
    }
    v.sort_by_key(|(name, b)| (*b, name.clone()));
    v
}

/// The device's copy of the output matrix.
pub fn head_segment(m: &Manifest) -> Result<&Segment, PlanError> {
    match m.segment(names::OUTPUT) {
        Some(s) => Ok(s),
        None => seg(m, names::TOKEN_EMBD),
    }
}

/// The format a stored segment has on the device: its own (bundles are f16 on the device).
pub fn device_dtype(s: &Segment) -> DType {
    s.encoding.dtype().unwrap_or(DType::F16)
}

/// The matrices an offloaded step multiplies, in their formats: the attention projections and,
/// for a block-quantized model, the FFN matrices of every layer (a bundled FFN runs on neuron
/// bundles, no matrix product), and the output matrix.
pub fn offload_matmuls(m: &Manifest) -> Result<MatmulShapes, PlanError> {
    let mut layer = Vec::new();
    for l in 0..m.spec.n_layers {
        for p in Part::ALL
            .into_iter()
            .filter(|&p| p != Part::Ffn && holds(m, p))
        {
            let s = seg(m, &part_segment_name(l, p))?;
            let k = MatmulShape {
                dtype: device_dtype(s),
                rows: s.rows,
                cols: s.cols,
            };
            if !layer.contains(&k) {
                layer.push(k);
            }
        }
    }
    let h = head_segment(m)?;
    Ok(MatmulShapes {
        layer,
        head: MatmulShape {
            dtype: device_dtype(h),
            rows: h.rows,
            cols: h.cols,
        },
    })
}

/// Device bytes of the parts of a layer held resident (one buffer per part).
fn resident_device_bytes(shape: &LayerShape, r: &Residency) -> u64 {
    Part::ALL
        .iter()
        .map(|&p| r.rows[p.index()] as u64 * shape.row_bytes[p.index()])
        .filter(|&b| b > 0)
        .map(device_bytes)
        .sum()
}

/// Device bytes of one streaming slot (one buffer per streamed part).
fn slot_device_bytes(shape: &LayerShape, r: &Residency) -> u64 {
    Part::ALL
        .iter()
        .map(|&p| r.streamed_rows(shape, p).len() as u64 * shape.row_bytes[p.index()])
        .filter(|&b| b > 0)
        .map(device_bytes)
        .sum()
}

/// The device memory of one step of `group` tokens on the CUDA backend (which the budgeted device
/// reserves the same way).
pub fn step_device_memory(
    m: &Manifest,
    budget: &Budget,
    group: usize,
) -> Result<StepMemory, PlanError> {
    Ok(step_memory(
        &m.spec,
        group,
        budget.logit_rows.min(group),
        budget.sessions > 1,
        budget.kv_type,
        &offload_matmuls(m)?,
        crate::footprint::workspace_bytes,
    ))
}

/// HyperGen's step-aware partitioning, for the budget's longest call (`budget.prompt`): the
/// step (row group) the device holds, and where a partitioned call's hidden states and the KV
/// cache live, as the first of these that leaves room for the least the model runs with
/// (`weights_min`: one streaming slot; or every layer resident, `all_layers`) beside
/// `fixed` (small fragments, output matrix):
/// 0. everything on the device, every layer resident beside a step larger than the budget's
///    (up to `max_step` and [`MAX_GROUP`] rows): the largest such step;
/// 1. everything on the device, the step as large as the budget asks;
/// 2. hidden states in host memory;
/// 3. the KV cache in host memory, hidden states on the device;
/// 4. both in host memory;
///
/// each with the largest step that fits, taken as soon as it is the call itself or at least
/// [`GOOD_GROUP`] rows (else the largest step of the four). Also the KV cache's, the step's and
/// the hidden states' device bytes.
fn prefill_layout(
    m: &Manifest,
    budget: &Budget,
    fixed: u64,
    usable: u64,
    all_layers: u64,
    weights_min: u64,
) -> Result<(PrefillLayout, u64, StepMemory, u64), PlanError> {
    let spec = &m.spec;
    let prompt = budget.prompt.max(1);
    let probe = if budget.probe { probe_bytes(spec) } else { 0 };
    let sessions = budget.sessions as u64;
    let kv_on_device = kv_bytes(spec, budget.ctx, budget.kv_type);
    // One layer's K and V, the context's length, on the device at a time.
    let kv_work = 2 * device_bytes((budget.ctx * budget.kv_type.row_bytes(spec.kv_dim())) as u64);
    let residual = device_bytes((prompt * spec.d_model * 4) as u64);
    let matmuls = offload_matmuls(m)?;
    // Several sequences (serve): prompts join their batched steps.
    let joins = budget.sessions > 1;
    let layout = |kv_host: bool, residual_on_device: bool, group: usize| {
        let step = step_memory(
            spec,
            group,
            budget.logit_rows.min(group),
            joins,
            budget.kv_type,
            &matmuls,
            crate::footprint::workspace_bytes,
        );
        // A pool lives on the device: with KV in host memory, each session keeps its own.
        let kv = match budget.kv_pool.filter(|_| !kv_host) {
            // The pool, and each session's block table and probe.
            Some(blocks) => {
                kv_pool_bytes(spec, blocks, budget.kv_type)
                    + sessions * (kv_table_bytes(budget.ctx) + probe)
            }
            None => sessions * (if kv_host { kv_work } else { kv_on_device } + probe),
        };
        let partitioned = prompt > group;
        let res = if partitioned && residual_on_device {
            residual
        } else {
            0
        };
        let held = fixed + kv + step.total() + res;
        let fits = held + all_layers <= usable || held + weights_min <= usable;
        let beside_all_layers = held + all_layers <= usable;
        let l = PrefillLayout {
            group,
            residual_rows: if partitioned && residual_on_device {
                prompt
            } else {
                0
            },
            kv_host,
            // Decided by the link rates (make_plan).
            cpu_attention: false,
            joins,
        };
        (fits, beside_all_layers, (l, kv, step, res))
    };
    let whole = budget.batch.min(prompt).max(1);
    // Every layer on the device with room for larger steps as well (a whole-GPU run): a call
    // longer than the budget's step runs in steps of up to MAX_GROUP rows, the largest that
    // still leaves every layer resident. Larger GEMMs fill the tensor cores better (a 512-row
    // product of a 4096-wide weight is ~1 wave of 128×128 tiles on an H100's 114 SMs) and a
    // call takes fewer launches; nothing the model runs with gives way for it.
    let grown = prompt.min(budget.max_step.min(MAX_GROUP));
    if !budget.cpu_split
        && budget.hot_reserve.is_none()
        && let Some(g) = largest_step(whole + 1, grown, |g| layout(false, true, g).1)
    {
        return Ok(layout(false, true, g).2);
    }
    let mut best: Option<(PrefillLayout, u64, StepMemory, u64)> = None;
    for (kv_host, residual_on_device) in
        [(false, true), (false, false), (true, true), (true, false)]
    {
        // The budget's step, the call in one step, else the largest partition that fits (the
        // bytes grow with the group: bisect).
        let mut found = [budget.batch.max(1), whole]
            .into_iter()
            .map(|g| layout(kv_host, residual_on_device, g))
            .find(|(fits, _, _)| *fits)
            .map(|(_, _, c)| c);
        if found.is_none() && whole > 1 {
            found = largest_step(1, whole - 1, |g| layout(kv_host, residual_on_device, g).0)
                .map(|g| layout(kv_host, residual_on_device, g).2);
        }
        let Some(c) = found else { continue };
        if c.0.group >= whole.min(GOOD_GROUP) {
            return Ok(c);
        }
        if best.as_ref().is_none_or(|b| c.0.group > b.0.group) {
            best = Some(c);
        }
    }
    // Nothing fits: the least the model runs with, whose shortfall the caller reports.
    Ok(best.unwrap_or_else(|| layout(true, false, 1).2))
}

/// The largest step of `lo..=hi` rows that `fits` (the bytes grow with the step: bisect), or
/// none where even `lo` does not.
fn largest_step(lo: usize, hi: usize, fits: impl Fn(usize) -> bool) -> Option<usize> {
    if lo > hi || !fits(lo) {
        return None;
    }
    let (mut lo, mut hi) = (lo, hi);
    while lo < hi {
        let mid = (lo + hi).div_ceil(2);
        if fits(mid) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    Some(lo)
}

/// Page-aligned extent of reading `rows` of a segment: what an SSD read of them costs.
fn extent(s: &Segment, rows: std::ops::Range<usize>) -> u64 {
    if rows.is_empty() {
        0
    } else {
        s.read_extent(rows).1
    }
}

/// The reads that load rows `rows` of `s` at start-up: runs of whole checksum groups of at most
/// [`STAGING_CHUNK_BYTES`].
pub fn staging_chunks(
    s: &Segment,
    rows: std::ops::Range<usize>,
) -> impl Iterator<Item = std::ops::Range<usize>> {
    let rb = s.row_bytes().max(1) as u64;
    let chunk = (STAGING_CHUNK_BYTES / rb / GROUP_ROWS as u64).max(1) as usize * GROUP_ROWS;
    let end = rows.end;
    rows.step_by(chunk).map(move |r| r..(r + chunk).min(end))
}

/// The staging buffer loading rows `0..rows` of `s` needs.
pub(crate) fn staging_for(s: &Segment, rows: usize) -> u64 {
    staging_chunks(s, 0..rows)
        .map(|c| extent(s, c))
        .max()
        .unwrap_or(0)
}

/// Plan `m` for `budget` on `hw`.
pub fn make_plan(m: &Manifest, budget: &Budget, hw: &HardwareProfile) -> Result<Plan, PlanError> {
    let spec = &m.spec;
    if budget.window == 0 {
        return Err(PlanError::Budget(
            "the prefetch window must be at least 1 layer".into(),
        ));
    }
    if budget.ctx == 0 || budget.batch == 0 {
        return Err(PlanError::Budget(
            "context and batch must be at least 1".into(),
        ));
    }
    if budget.sessions == 0 {
        return Err(PlanError::Budget("at least one session must fit".into()));
    }
    if let Err(e) = budget.kv_type.check_cols(spec.kv_dim()) {
        return Err(PlanError::Budget(e.to_string()));
    }
    let n_layers = spec.n_layers;
    let shapes = layer_shapes(m)?;
    let shape = widest(&shapes);
    let s_layer = shape.total();
    let fixed_cost = hw.fixed_device_bytes();
    let small: u64 = small_fragments(m)
        .iter()
        .map(|&(_, b)| device_bytes(b))
        .sum();
    let head = device_bytes(head_segment(m)?.bytes);
    let none = Residency::default();
    let all = Residency::all(&shape);
    let usable = budget.gpu_mem.saturating_sub(fixed_cost);
    let resident_all_layers =
        |r: &Residency| -> u64 { shapes.iter().map(|sh| resident_device_bytes(sh, r)).sum() };
    let (prefill, kv, step, residual) = prefill_layout(
        m,
        budget,
        small + head,
        usable,
        resident_all_layers(&all),
        slot_device_bytes(&shape, &none),
    )?;
    let per_session = kv / budget.sessions as u64;
    // A partitioned prompt's hidden states count with the step's buffers.
    let scratch = step.activations + step.logits + residual;
    let fixed = small + head + kv + scratch + step.workspace;
    let minimum_with = |w: usize| fixed + w as u64 * slot_device_bytes(&shape, &none);
    // The prefetch window asked for, or the widest narrower one the budget holds (a window of
    // one layer is the least that runs).
    let asked = budget.window.min(n_layers);
    let window = (1..=asked)
        .rev()
        .find(|&w| usable >= minimum_with(w))
        .unwrap_or(1);
    let minimum = minimum_with(window);
    let kv_what = match budget.kv_pool.filter(|_| !prefill.kv_host) {
        Some(blocks) => format!(
            "a KV pool of {} positions for {} sessions (--kv-pool-tokens)",
            blocks * crate::backend::KV_BLOCK,
            budget.sessions
        ),
        None => format!(
            "KV cache for {} × {} positions",
            budget.sessions, budget.ctx
        ),
    };
    let breakdown = |slots: u64| {
        format!(
            "fixed device cost {} (context, kernels, cuBLAS), small fragments {}, output matrix {}, {kv_what} {} ({}), step buffers {}, workspace {}, {window} streaming slots {}",
            human_bytes(fixed_cost),
            human_bytes(small),
            human_bytes(head),
            human_bytes(kv),
            budget.kv_type.name(),
            human_bytes(scratch),
            human_bytes(step.workspace),
            human_bytes(slots)
        )
    };
    let all_resident = fixed + resident_all_layers(&all) <= usable;
    if !all_resident && usable < minimum {
        return Err(PlanError::GpuTooSmall {
            budget: budget.gpu_mem,
            minimum: fixed_cost + minimum,
            breakdown: breakdown(minimum - fixed),
        });
    }
    let grouped_query = spec.n_kv_heads < spec.n_heads;
    let placed_with = |r: &Residency, k: usize| {
        fixed + resident_all_layers(r) + k as u64 * slot_device_bytes(&shape, r)
    };
    // The residency that fits with the last `cpu` FFN neurons of every layer computed by the
    // CPU (0: none): the device's share of each layer is the rest.
    // `ffn_off`: no FFN row on the device at all (hybrid with streamed attention).
    let fit = |cpu: usize, ffn_off: bool, merge: u64| -> Residency {
        let mut dev = shape;
        dev.rows[Part::Ffn.index()] -= cpu;
        if ffn_off {
            Part::FFN.iter().for_each(|p| dev.rows[p.index()] = 0);
        }
        let s_dev = dev.total();
        let with_cpu = |r: Residency| Residency {
            cpu_rows: cpu,
            ffn_off,
            ..r
        };
        if all_resident && cpu == 0 && !ffn_off {
            return all;
        }
        // L·r + k·(S − r) ≤ A  ⇒  r ≤ (A − k·S) / (L − k); L > k here (else all resident fits).
        // Granule rounding makes that a first guess: shrink until the rounded total fits (no
        // residency always does: that is the minimum).
        let avail = usable.saturating_sub(fixed + merge);
        let mut per_layer = (avail.saturating_sub(window as u64 * s_dev)
            / (n_layers - window).max(1) as u64)
            .min(s_dev);
        loop {
            let r = with_cpu(preserve(&dev, per_layer, grouped_query));
            let placed = placed_with(&r, window) + merge;
            if placed <= usable || per_layer == 0 {
                break r;
            }
            let over = (placed - usable).div_ceil((n_layers - window).max(1) as u64);
            per_layer = per_layer.saturating_sub(over.max(crate::footprint::DEVICE_ALIGN));
        }
    };
    let (mut residency, window) = if all_resident {
        (all, 0)
    } else {
        (fit(0, false, 0), window)
    };
    // The CPU+PCIe split (bundled FFNs, the DRAM holding the model): of the neurons that do not
    // fit, the last ones are computed by the CPU from DRAM instead of streamed, as many as make
    // the CPU take as long as the copies of what still streams: with `a` other streamed bytes,
    // `n` neurons off the device of `b` bytes, PCIe rate `p` and DRAM rate `d`,
    // (a + (n − c)·b)/p = c·b/d. The slots shrink with it, which leaves room for more resident
    // rows, which changes the balance: a few rounds settle it; the first round's merge buffer
    // must fit too.
    let mut merge = 0;
    if let Some(reserve) = budget.hot_reserve
        && window > 0
    {
        // Every FFN neuron off the device (the CPU's, less the hot ones placed later in
        // `reserve`); attention resident and streamed in what is left.
        let with_merge = device_bytes((budget.batch * spec.d_model * 4) as u64);
        let r = fit(0, true, with_merge + reserve);
        let placed = placed_with(&r, window) + with_merge + reserve;
        if placed > usable {
            return Err(PlanError::GpuTooSmall {
                budget: budget.gpu_mem,
                minimum: fixed_cost + placed,
                breakdown: format!(
                    "{} kept for hot neurons beside {}",
                    human_bytes(reserve),
                    breakdown(window as u64 * slot_device_bytes(&shape, &r))
                ),
            });
        }
        residency = r;
        merge = with_merge;
    } else if budget.cpu_split && window > 0 && budget.dram_mem.is_none() && holds(m, Part::Ffn) {
        let f = Part::Ffn.index();
        let (rows, b) = (shape.rows[f], shape.row_bytes[f]);
        let (p, d) = (hw.h2d_pinned_bytes_per_s, hw.dram_read_bytes_per_s);
        let with_merge = device_bytes((budget.batch * spec.d_model * 4) as u64);
        let mut cur = residency;
        for _ in 0..4 {
            let n = rows - cur.rows[f];
            let others =
                cur.streamed_bytes(&shape) - cur.streamed_rows(&shape, Part::Ffn).len() as u64 * b;
            let c = (((others + n as u64 * b) as f64 * d / (b as f64 * (p + d))) as usize).min(n);
            // What still streams ends on a checksum group (or is nothing).
            let end = (rows - c).div_ceil(GROUP_ROWS) * GROUP_ROWS;
            let c = rows - end.clamp(cur.rows[f], rows);
            if c == cur.cpu_rows {
                break;
            }
            cur = fit(c, false, with_merge);
        }
        if cur.cpu_rows > 0 && placed_with(&cur, window) + with_merge <= usable {
            residency = cur;
            merge = with_merge;
        }
    }
    let r = residency.resident_bytes(&shape);
    let s = s_layer - r - residency.cpu_bytes(&shape);
    let placed = placed_with(&residency, window) + merge;
    let gpu = GpuBytes {
        merge,
        fixed: fixed_cost,
        small,
        head,
        resident_layers: resident_all_layers(&residency),
        slots: window as u64 * slot_device_bytes(&shape, &residency),
        kv,
        scratch,
        workspace: step.workspace,
        placed,
        total: fixed_cost + placed,
    };

    // DRAM: tables, staging at start-up, streamed layers (fixed area, then dynamic buffers).
    // Tables are held in whole pages.
    let page = |b: u64| b.next_multiple_of(crate::store::ALIGN);
    let emb = seg(m, names::TOKEN_EMBD)?;
    let tables = page(emb.bytes) + m.segment(names::POS_EMBD).map_or(0, |p| page(p.bytes));
    // Per layer: the bytes its streamed rows take read from SSD (whole pages), and the most a
    // start-up read of its resident rows takes. A DRAM buffer holds any layer: each part's
    // widest extent over the layers (formats and page offsets differ between layers).
    let mut layer_extents = Vec::with_capacity(n_layers);
    let mut widest_extent = [0u64; PARTS];
    let mut staging = 0u64;
    for l in 0..n_layers {
        let mut e = 0;
        for p in Part::ALL.into_iter().filter(|&p| holds(m, p)) {
            let sg = seg(m, &part_segment_name(l, p))?;
            let x = extent(sg, residency.streamed_rows(&shape, p));
            e += x;
            widest_extent[p.index()] = widest_extent[p.index()].max(x);
            staging = staging.max(staging_for(sg, residency.rows[p.index()]));
        }
        layer_extents.push(e);
    }
    let layer_bytes: u64 = widest_extent.iter().sum();
    for (name, _) in small_fragments(m) {
        if let Some(sg) = m.segment(&name) {
            staging = staging.max(staging_for(sg, sg.rows));
        }
    }
    let h = head_segment(m)?;
    staging = staging.max(staging_for(h, h.rows));
    let all_streamed: u64 = layer_extents.iter().sum();
    let (fixed_layers, dynamic_buffers) = match budget.dram_mem {
        _ if s == 0 => (n_layers, 0),
        None => (n_layers, 0),
        Some(d) if d >= tables + all_streamed && d >= tables + staging => (n_layers, 0),
        Some(d) => {
            let dynamic = DYNAMIC_BUFFERS.min(n_layers);
            let need = tables + (dynamic as u64 * layer_bytes).max(staging);
            if d < need {
                return Err(PlanError::DramTooSmall {
                    budget: d,
                    minimum: need,
                    breakdown: format!(
                        "embedding tables {}, {dynamic} dynamic layer buffers of {}",
                        human_bytes(tables),
                        human_bytes(layer_bytes)
                    ),
                });
            }
            let f = ((d - tables - dynamic as u64 * layer_bytes) / layer_bytes.max(1)) as usize;
            (f.min(n_layers - dynamic), dynamic)
        }
    };
    if let Some(d) = budget.dram_mem
        && d < tables + staging
    {
        return Err(PlanError::DramTooSmall {
            budget: d,
            minimum: tables + staging,
            breakdown: format!(
                "embedding tables {} MiB, start-up staging {} MiB",
                tables >> 20,
                staging >> 20
            ),
        });
    }
    let cpu_rows = n_layers as u64 * residency.cpu_bytes(&shape);
    // Held as read: whole pages.
    let mut cpu_rows_dram = 0;
    if cpu_rows > 0 {
        for l in 0..n_layers {
            for p in Part::FFN.into_iter().filter(|&p| holds(m, p)) {
                let sg = seg(m, &part_segment_name(l, p))?;
                cpu_rows_dram += extent(sg, residency.cpu_rows_of(&shape, p));
            }
        }
    }
    let dram = DramPlan {
        tables,
        staging,
        layer_bytes,
        fixed_layers,
        dynamic_buffers,
        cpu_rows: cpu_rows_dram,
        total: tables + (fixed_layers + dynamic_buffers) as u64 * layer_bytes + cpu_rows_dram,
    };

    // Per decoded token: streamed layers + the input row in; logits out; the dynamic layers
    // from SSD; device compute reads every weight and half the KV cache on average.
    let streamed_all: u64 = shapes.iter().map(|sh| residency.streamed_bytes(sh)).sum();
    // A KV cache in host memory is read for every token, half the context on average: over
    // PCIe, a layer at a time, or by the CPU from DRAM (the token's q, k, v down and the
    // attention output up) — whichever is faster (the bytes are the same): the CPU at the rate
    // it attends (measured by `doctor`, else the DRAM read rate).
    let mut prefill = prefill;
    prefill.cpu_attention = prefill.kv_host && hw.cpu_attention_rate() >= hw.h2d_pinned_bytes_per_s;
    let kv_mid = if prefill.kv_host {
        kv_bytes(spec, budget.ctx, budget.kv_type) / 2
    } else {
        0
    };
    let (kv_in, kv_cpu) = if prefill.cpu_attention {
        (0, kv_mid)
    } else {
        (kv_mid, 0)
    };
    let (rows_in, rows_out) = cpu_attention_rows(spec, prefill);
    let per_token = PerToken {
        h2d_bytes: streamed_all + spec.d_model as u64 * 4 + kv_in + rows_in,
        d2h_bytes: spec.vocab_size as u64 * 4 + kv_row_out(spec, budget, prefill) + rows_out,
        ssd_bytes: if s == 0 {
            0
        } else {
            layer_extents[fixed_layers..].iter().sum()
        },
        hbm_read_bytes: small + head + shapes.iter().map(LayerShape::total).sum::<u64>() - cpu_rows
            + per_session / 2,
        cpu_read_bytes: cpu_rows + kv_cpu,
    };
    // Ops per token: per layer about 14 (norms, 4 projections, rope, attention, FFN, adds)
    // plus one per streamed block.
    let streamed_blocks = Part::ALL
        .iter()
        .filter(|&&p| !residency.streamed_rows(&shape, p).is_empty())
        .count();
    let ops = n_layers * (14 + streamed_blocks) + 4;
    let pcie_s = per_token.h2d_bytes as f64 / hw.h2d_pinned_bytes_per_s;
    let ssd_s = per_token.ssd_bytes as f64 / hw.ssd_read_bytes_per_s;
    let hbm_s = per_token.hbm_read_bytes as f64 / hw.hbm_bytes_per_s;
    let ops_s = ops as f64 * hw.op_overhead_s;
    // The CPU's share runs between the device's ops of its layer: serial with them, overlapping
    // the copies; each layer pays a round trip (the FFN input down, the partial sum up).
    let cpu_s = kv_cpu as f64 / hw.cpu_attention_rate()
        + if cpu_rows > 0 {
            let vector = (spec.d_model * 4) as f64;
            cpu_rows as f64 / hw.dram_read_bytes_per_s
                + n_layers as f64 * 2.0 * (hw.op_overhead_s + vector / hw.h2d_pinned_bytes_per_s)
        } else {
            0.0
        };
    let (limited_by, bound) = [
        ("PCIe", pcie_s),
        ("SSD", ssd_s),
        ("HBM", hbm_s),
        ("HBM+CPU", hbm_s + cpu_s),
    ]
    .into_iter()
    .fold(
        ("HBM", 0.0),
        |acc, (n, t)| if t > acc.1 { (n, t) } else { acc },
    );
    let prediction = Prediction {
        tokens_per_s: 1.0 / (bound + ops_s),
        limited_by: limited_by.to_string(),
        pcie_s,
        ssd_s,
        hbm_s,
        cpu_s,
        ops_s,
    };
    Ok(Plan {
        model_id: m.model_id.clone(),
        model: spec.name.clone(),
        spec: spec.clone(),
        hardware: hw.clone(),
        budget: budget.clone(),
        shape,
        residency,
        window,
        resident_bytes_per_layer: r,
        streamed_bytes_per_layer: s,
        gpu,
        dram,
        per_token,
        prediction,
        prefill,
    })
}

#[cfg(test)]
mod tests {
    use super::human_bytes;

    #[test]
    fn human_bytes_rounds_up_in_binary_units() {
        assert_eq!(human_bytes(512), "512 B");
        assert_eq!(human_bytes(300 * 1024), "300.0 KiB");
        assert_eq!(human_bytes((3 << 29) + 1), "1.6 GiB");
        assert_eq!(human_bytes(1 << 20), "1.0 MiB");
    }
}
