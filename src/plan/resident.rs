//! What the sparse modes (hybrid execution, cache units) keep whole on the device: every
//! layer's attention, the small fragments, the output matrix, the KV cache and step memory
//! (`Base`), the FFN neurons placed in what the budget leaves; and the per-token record both
//! report ([`SparsePerToken`]). What `Resident` of [`crate::tier::resident`] loads.
//!
//! Fails with [`PlanError::GpuTooSmall`] where not even that and the hot tensors' rounding fit.

use serde::Serialize;

use crate::footprint::device_bytes;
use crate::store::Manifest;

use super::Plan;
use super::budget::{PlanError, human_bytes};
use super::cold::{FfnLayout, hot_rounding};
use super::manifest::{head_segment, part_segment_name, seg, small_fragments, staging_for};
use super::preserve::Part;

/// Bytes per decoded token by resource of a sparse plan (hybrid or cache units), expected at
/// the profile's frequencies.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SparsePerToken {
    /// What the device reads: attention, the neurons it computes (hot, or in their units),
    /// head, half the KV cache.
    pub hbm_bytes: u64,
    /// What the CPU reads from DRAM: the cold neurons (hybrid), the deciding vectors (units).
    pub cpu_bytes: u64,
    /// The reads the CPU's neuron-sparse pass takes them in (hybrid's cold neurons; 0 where
    /// nothing is priced by its reads): [`super::HardwareProfile::cpu_sparse_seconds`].
    pub cpu_reads: f64,
    /// Host→device and back: the FFN input and partial sums or the units' loads, every layer;
    /// logits out.
    pub pcie_bytes: u64,
}

impl SparsePerToken {
    /// Bytes by resource, with none of them priced by its reads.
    pub fn of_bytes(hbm_bytes: u64, cpu_bytes: u64, pcie_bytes: u64) -> Self {
        SparsePerToken {
            hbm_bytes,
            cpu_bytes,
            cpu_reads: 0.0,
            pcie_bytes,
        }
    }
}

/// Which sparse mode a [`Base`] is for: hybrid execution brings the CPU's partial sums back
/// into a merge buffer; cache units compute every neuron on the device and need none.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum BaseFor {
    Hybrid,
    Units,
}

/// Everything hybrid execution holds besides the hot neurons.
pub(super) struct Base {
    pub(super) attention: u64,
    /// Per layer, the attention matrices' bytes (what the device reads of them per token).
    pub(super) attention_layers: Vec<u64>,
    pub(super) staging: u64,
    pub(super) merge: u64,
    pub(super) everything_else: u64,
    /// What the ILP may place (raw bytes), with room for each hot tensor's rounding.
    pub(super) budget_bytes: u64,
    /// Bytes the link brings per token beside the FFN's: attention that does not fit, and a
    /// host-kept KV cache's rows so far where the device attends it.
    pub(super) streamed: u64,
}

/// Each layer's FFN layout and attention bytes.
pub(super) fn layers_of(
    m: &Manifest,
    n_layers: usize,
) -> Result<(Vec<FfnLayout>, Vec<u64>), PlanError> {
    let layouts = (0..n_layers)
        .map(|l| FfnLayout::of(m, l))
        .collect::<Result<Vec<_>, _>>()?;
    let attention = (0..n_layers)
        .map(|l| {
            attention_parts(l)
                .iter()
                .map(|&(l, p)| seg(m, &part_segment_name(l, p)).map(|s| s.bytes))
                .sum::<Result<u64, _>>()
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok((layouts, attention))
}

/// The hybrid device bytes besides the hot neurons, and each layer's FFN layout.
/// What everything but the FFN neurons takes on the device when every layer's attention is
/// resident: with the merge buffer of hybrid execution ([`BaseFor::Hybrid`]), or without
/// ([`BaseFor::Units`]: cache units).
pub(super) fn base_of(
    m: &Manifest,
    plan: &Plan,
    mode: BaseFor,
) -> Result<(Base, Vec<FfnLayout>), PlanError> {
    let spec = &plan.spec;
    let n_layers = spec.n_layers;
    let rows = super::batch::step_rows(&plan.budget, &plan.prefill);
    let kv = super::cost::HostKv::of(plan, rows);
    let (layouts, attention_layers) = layers_of(m, n_layers)?;
    let mut attention = 0;
    let mut staging = 0;
    for (l, p) in (0..n_layers).flat_map(attention_parts) {
        let s = seg(m, &part_segment_name(l, p))?;
        attention += device_bytes(s.bytes);
        staging = staging.max(staging_for(s, s.rows));
    }
    let head = head_segment(m)?;
    staging = staging.max(staging_for(head, head.rows));
    for (name, _) in small_fragments(m) {
        if let Some(s) = m.segment(&name) {
            staging = staging.max(staging_for(s, s.rows));
        }
    }
    let merge = match mode {
        BaseFor::Hybrid => device_bytes((plan.budget.batch * spec.d_model * 4) as u64),
        BaseFor::Units => 0,
    };
    let g = &plan.gpu;
    let everything_else = g.small + g.head + g.kv + g.scratch + g.workspace + attention + merge;
    let usable = plan.budget.gpu_mem.saturating_sub(g.fixed);
    let rounding = hot_rounding(&layouts);
    if usable < everything_else + rounding {
        return Err(PlanError::GpuTooSmall {
            budget: plan.budget.gpu_mem,
            minimum: g.fixed + everything_else + rounding,
            breakdown: format!(
                "{} keeps every layer's attention resident ({}), with the small fragments {}, output matrix {}, KV cache {}, step buffers {}, workspace {} and the merge buffer {}",
                if merge > 0 {
                    "hybrid execution"
                } else {
                    "cache units"
                },
                human_bytes(attention),
                human_bytes(g.small),
                human_bytes(g.head),
                human_bytes(g.kv),
                human_bytes(g.scratch),
                human_bytes(g.workspace),
                human_bytes(merge)
            ),
        });
    }
    Ok((
        Base {
            attention,
            attention_layers,
            staging,
            merge,
            everything_else,
            budget_bytes: usable - everything_else - rounding,
            streamed: kv.link,
        },
        layouts,
    ))
}

fn attention_parts(l: usize) -> [(usize, Part); 4] {
    Part::ATTENTION.map(move |p| (l, p))
}
