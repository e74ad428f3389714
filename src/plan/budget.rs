//! What a plan must fit in and how it refuses: the [`Budget`] (device and host memory, the
//! prefetch window, contexts, sessions and the sequences a decode step takes, step sizes, the
//! execution mode's switches) and
//! [`PlanError`], whose messages state the least that would do, in [`human_bytes`].
//!
//! Pure data: no planning here (that is [`super::stream`] and the modes above it).

use serde::Serialize;
use thiserror::Error;

use crate::backend::KvType;
use crate::footprint::MAX_GROUP;

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
    /// Sequences one decode step evaluates a token of (continuous batching; usually every
    /// session): what decode is costed for, each mode's prediction being the aggregate tokens/s
    /// of all of them ([`super::batch`]). 1: one sequence alone.
    pub sequences: usize,
    /// A paged KV pool of this many blocks ([`crate::backend::KV_BLOCK`] positions each) shared
    /// by the sessions, in place of a cache of `ctx` positions per session (serve). Where only
    /// KV in host memory fits
    /// ([`PrefillLayout::kv_host`](crate::footprint::PrefillLayout::kv_host)), the sessions
    /// keep theirs there.
    #[serde(default)]
    pub kv_pool: Option<usize>,
    /// Element type of the KV cache on the device.
    pub kv_type: KvType,
    /// Whether each session keeps a query probe (serve's contexts measure attention density).
    pub probe: bool,
    /// Most tokens one forward step evaluates (prefill batch).
    pub batch: usize,
    /// Most tokens one forward call evaluates (the longest prompt): a call longer than the
    /// step the budget holds runs layer by layer in row groups
    /// ([`PrefillLayout`](crate::footprint::PrefillLayout)), its hidden states kept on the
    /// device where this many rows fit.
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
    /// neurons to be placed in this many bytes kept free (see
    /// [`plan_cold`](super::choice::plan_cold)).
    pub hot_reserve: Option<u64>,
    /// Cache units with streamed attention: the FFN off the device, the units, their staging
    /// (and any hybrid layers with their merge buffer) to be placed in this many bytes kept
    /// free; no merge buffer beside (see [`plan_units_streamed`](super::units::plan_units_streamed)).
    pub unit_reserve: Option<u64>,
    /// Mixture-of-experts units: guess each layer's experts from the previous layer's FFN input
    /// and start their copies early (next-layer prefetch).
    pub expert_prefetch: bool,
    /// Mixture-of-experts: a decode step's low-ranked misses computed on the device from copies
    /// in this block format (`--expert-low-bit`; `None`: every expert at full precision).
    pub expert_low_bit: Option<crate::tensor::DType>,
    /// `--sparsity predicted`: the profile's predictors name each step's neurons; the sparse
    /// plans cost them (their weights on the host, the neurons they name) in place of the
    /// deciding reads.
    pub predicted: bool,
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
            sequences: 1,
            kv_pool: None,
            kv_type: KvType::F16,
            probe: false,
            batch,
            prompt: batch,
            logit_rows: 1,
            max_step: MAX_GROUP,
            cpu_split: false,
            hot_reserve: None,
            unit_reserve: None,
            predicted: false,
            expert_prefetch: true,
            expert_low_bit: None,
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
