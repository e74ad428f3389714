//! The DRAM plan of a streaming plan (M2Cache's two-level cache): the embedding tables, the
//! start-up staging buffer, and the layers' streamed parts — the first ones fixed in DRAM, the
//! others cycling through a few dynamic buffers refilled from SSD ahead of use. What
//! [`crate::tier::dram::DramCache`] carries out.
//!
//! Algorithm: one pass over the layers' segments (page-aligned extents of the streamed rows,
//! the widest of each part sizing a buffer), then as many fixed layers as the DRAM budget holds
//! beside the tables and [`DYNAMIC_BUFFERS`]. Fails with [`PlanError::DramTooSmall`] where the
//! tables and the dynamic buffers, or the tables and the staging buffer, do not fit.

use crate::store::{Manifest, names};

use super::DramPlan;
use super::budget::{Budget, PlanError, human_bytes};
use super::manifest::{
    extent, head_segment, holds, part_segment_name, seg, small_fragments, staging_for,
};
use super::preserve::{LayerShape, PARTS, Part, Residency};
use super::split::cpu_rows_dram;

/// Dynamic DRAM buffers when the DRAM budget cannot hold every streamed layer: the layer being
/// copied to the device, the one whose copy may still be in flight, and two read ahead.
pub const DYNAMIC_BUFFERS: usize = 4;

/// The DRAM plan, and what it reads from SSD per token.
pub(super) struct DramLayers {
    pub(super) plan: DramPlan,
    /// The dynamic layers' streamed extents, read for every token (0 where nothing streams).
    pub(super) ssd_bytes: u64,
}

/// Per layer, the bytes its streamed rows take read from SSD (whole pages); the widest layer's
/// (what a DRAM buffer holds); and the most a start-up read of resident rows takes.
struct Extents {
    layers: Vec<u64>,
    layer_bytes: u64,
    staging: u64,
}

/// DRAM for `residency` of `shape` in every layer of `m` within `budget`: `s` bytes of each
/// layer stream, `cpu_rows` bytes of all layers are the CPU's (the split).
pub(super) fn plan_dram(
    m: &Manifest,
    budget: &Budget,
    shape: &LayerShape,
    residency: &Residency,
    s: u64,
    cpu_rows: u64,
) -> Result<DramLayers, PlanError> {
    let n_layers = m.spec.n_layers;
    // DRAM: tables, staging at start-up, streamed layers (fixed area, then dynamic buffers).
    // Tables are held in whole pages.
    let page = |b: u64| b.next_multiple_of(crate::store::ALIGN);
    let emb = seg(m, names::TOKEN_EMBD)?;
    let tables = page(emb.bytes) + m.segment(names::POS_EMBD).map_or(0, |p| page(p.bytes));
    let Extents {
        layers: layer_extents,
        layer_bytes,
        staging,
    } = extents(m, shape, residency)?;
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
    // Held as read: whole pages.
    let cpu_rows_dram = if cpu_rows > 0 {
        cpu_rows_dram(m, shape, residency)?
    } else {
        0
    };
    Ok(DramLayers {
        plan: DramPlan {
            tables,
            staging,
            layer_bytes,
            fixed_layers,
            dynamic_buffers,
            cpu_rows: cpu_rows_dram,
            total: tables + (fixed_layers + dynamic_buffers) as u64 * layer_bytes + cpu_rows_dram,
        },
        ssd_bytes: if s == 0 {
            0
        } else {
            layer_extents[fixed_layers..].iter().sum()
        },
    })
}

/// Per layer: the bytes its streamed rows take read from SSD (whole pages), and the most a
/// start-up read of its resident rows takes. A DRAM buffer holds any layer: each part's
/// widest extent over the layers (formats and page offsets differ between layers). Staging
/// loads the small fragments and the output matrix too.
fn extents(m: &Manifest, shape: &LayerShape, residency: &Residency) -> Result<Extents, PlanError> {
    let n_layers = m.spec.n_layers;
    let mut layer_extents = Vec::with_capacity(n_layers);
    let mut widest_extent = [0u64; PARTS];
    let mut staging = 0u64;
    for l in 0..n_layers {
        let mut e = 0;
        for p in Part::ALL.into_iter().filter(|&p| holds(m, p)) {
            let sg = seg(m, &part_segment_name(l, p))?;
            let x = extent(sg, residency.streamed_rows(shape, p));
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
    Ok(Extents {
        layers: layer_extents,
        layer_bytes,
        staging,
    })
}
