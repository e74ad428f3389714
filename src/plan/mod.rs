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
//! rounded to the allocation granule ([`crate::footprint::device_bytes`]), and a step's
//! activations and workspace come from the engine's and the CUDA backend's own formulas
//! ([`crate::footprint::step_memory`], [`crate::footprint::workspace_bytes`]) — so what the plan
//! accepts, the budgeted device and the GPU both run.
//!
//! The files, from the bottom up (each imports only those before it):
//! - [`budget`]: what a plan must fit in ([`Budget`]) and how it refuses ([`PlanError`]);
//!   [`hardware`]: the rates and fixed costs of a machine;
//! - [`manifest`]: the store's segments as the planner reads them;
//!   [`preserve`](mod@preserve): which rows of a layer stay resident for a per-layer share;
//! - [`prefill`]: how a long call runs (step, hidden states, KV cache);
//! - this file: the [`Plan`] itself, as data;
//! - [`batch`]: what a decode step of several sequences shares and what grows with them;
//! - [`split`]: how many FFN neurons the CPU computes; [`dram`]: the DRAM plan; [`cost`]: what a
//!   token moves and how fast it runs, for one sequence or a step of several;
//! - [`stream`]: the streaming plan, [`make_plan`] (with the split where asked);
//! - `report`: the plan as a table;
//! - the sparse modes by the sparsity profile: [`placement`] (the exact hot-neuron ILP),
//!   [`cold`] (what a layer's FFN neurons cost hot and cold), [`resident`] (everything but the
//!   FFN resident), [`hybrid`] (hot neurons on the device, the CPU computing the rest),
//!   [`precision`] and [`units`] (cache units in mixed precision);
//! - [`choice`]: which mode runs the neurons that do not fit (`--cold`);
//! - [`experts`]: a mixture-of-experts model's expert cache units (or all its experts on the
//!   CPU) beside everything else resident.
//!
//! A mode is named alike here and in [`crate::tier`]: `plan/X.rs` decides it, `tier/X.rs` holds
//! its bytes.

pub mod batch;
pub mod budget;
pub mod choice;
pub mod cold;
pub mod cost;
pub mod dram;
pub mod expert_host;
pub mod expert_low_bit;
mod expert_prefill;
pub mod expert_shape;
pub mod experts;
pub mod hardware;
pub mod hybrid;
pub mod manifest;
pub mod placement;
pub mod precision;
pub mod prefill;
pub mod preserve;
mod report;
pub mod resident;
pub mod split;
pub mod stream;
pub mod units;
mod units_report;

use serde::Serialize;

use crate::footprint::PrefillLayout;
use crate::model::ModelSpec;

pub use budget::{Budget, PlanError, human_bytes};
pub use cost::{PrefillPrediction, causal_attention_flops};
pub use dram::DYNAMIC_BUFFERS;
pub use hardware::HardwareProfile;
pub use manifest::{
    STAGING_CHUNK_BYTES, device_dtype, head_segment, layer_shape, layer_shapes, offload_matmuls,
    part_segment_name, small_fragments, staging_chunks, widest_dtype,
};
pub use prefill::step_device_memory;
pub use preserve::{LayerShape, PARTS, Part, Residency, preserve};
pub use stream::make_plan;

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
    /// Where the CPU's partial sums come back to, hybrid's over streamed attention (0
    /// without; the split's CPU rows continue the device's sum and need none).
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

/// Predicted decode speed. The seconds are of one decode step of `step.sequences` rows (a token
/// of each sequence; of one token where a sequence decodes alone), `tokens_per_s` the aggregate
/// of all of them ([`batch`]).
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
    /// What one step of several sequences moves and computes.
    pub step: DecodeStep,
}

/// One decode step of several sequences: bytes read once for all of them, bytes and FLOPs of
/// every row ([`batch`]). With one sequence the bytes are [`PerToken`]'s and the FLOPs bound
/// nothing.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct DecodeStep {
    /// Rows the step evaluates: a token of each sequence.
    pub sequences: usize,
    pub h2d_bytes: u64,
    pub hbm_read_bytes: u64,
    pub cpu_read_bytes: u64,
    /// FLOPs of the device's products and attention, and of the CPU's FFN rows.
    pub device_flops: f64,
    pub cpu_flops: f64,
    /// The device's FLOPs at its product rate (0 for one row: its bytes bound it).
    pub compute_s: f64,
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
}
