//! What a layer's FFN neurons cost, hot on the device or cold on the CPU, as the sparse modes
//! (hybrid execution, cache units) place them: [`ColdCost`], what the CPU reads for cold
//! neurons per token, and the layer's FFN layout as stored (bundles, or block-quantized
//! matrices placed in whole down blocks), with the device bytes its hot share takes the way the
//! sources allocate them. What [`crate::tier::cold`] carries out.
//!
//! Reads the manifest only; fails where a segment is missing or the FFN's shape does not split
//! into whole blocks.

use serde::Serialize;

use crate::footprint::{DEVICE_ALIGN, device_bytes};
use crate::store::{Manifest, SegmentKind, names};
use crate::tensor::{DType, QK};

use super::budget::PlanError;
use super::manifest::{part_segment_name, seg};
use super::preserve::Part;

/// What the CPU reads for a layer's cold neurons, per token: every candidate neuron's deciding
/// vector (the gate, or the up row without a gate), the rest of each neuron that turns out active
/// and, for block-format down matrices, every down block (a unit, all `d_model` rows) holding an
/// active neuron.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct ColdCost {
    pub decide_bytes: u64,
    pub active_bytes: u64,
    pub unit_bytes: u64,
    /// Neurons per unit (1 for bundles).
    pub unit: usize,
}

impl ColdCost {
    /// Bytes read for `candidates` neurons examined, `active` of them computed, `units` down
    /// blocks touched.
    pub fn bytes(&self, candidates: u64, active: u64, units: u64) -> u64 {
        self.decide_bytes * candidates + self.active_bytes * active + self.unit_bytes * units
    }
}

/// A layer's FFN as stored, for placement.
pub(super) struct FfnLayout {
    /// Bytes of one unit of neurons on the device.
    pub(super) unit_bytes: u64,
    pub(super) cost: ColdCost,
    /// Device tensors its hot share takes (each rounded to the granule).
    tensors: u64,
    /// Bundles: bytes of one neuron; matrices: (gate row, up row, down format, up bias).
    kind: FfnKind,
}

enum FfnKind {
    Bundles {
        row_bytes: u64,
    },
    Matrices {
        gate_row: u64,
        up_row: u64,
        down: DType,
        d_model: usize,
        up_bias: bool,
    },
}

impl FfnLayout {
    /// Layer `l`'s FFN as `m` stores it.
    pub(super) fn of(m: &Manifest, l: usize) -> Result<Self, PlanError> {
        let spec = &m.spec;
        let (d, d_ff) = (spec.d_model, spec.d_ff);
        if let Some(s) = m.segment(&part_segment_name(l, Part::Ffn)) {
            let SegmentKind::Bundles { parts } = s.kind else {
                return Err(PlanError::Store(format!("`{}` is not bundles", s.name)));
            };
            let row = s.row_bytes() as u64;
            let part = row / parts as u64;
            return Ok(FfnLayout {
                unit_bytes: row,
                cost: ColdCost {
                    decide_bytes: part,
                    active_bytes: row - part,
                    unit_bytes: 0,
                    unit: 1,
                },
                tensors: 1,
                kind: FfnKind::Bundles { row_bytes: row },
            });
        }
        let up = seg(m, &part_segment_name(l, Part::Up))?;
        let down = seg(m, &part_segment_name(l, Part::Down))?;
        let gate = if spec.gated_ffn {
            Some(seg(m, &part_segment_name(l, Part::Gate))?)
        } else {
            None
        };
        let Some(down_dtype) = down.encoding.dtype() else {
            return Err(PlanError::Store(format!("`{}` is not a matrix", down.name)));
        };
        let unit = down_dtype.block_len().max(QK);
        if !d_ff.is_multiple_of(unit) {
            return Err(PlanError::Store(format!(
                "d_ff {d_ff} is not a multiple of the {unit}-neuron blocks of `{}`",
                down.name
            )));
        }
        let (gate_row, up_row) = (
            gate.map_or(0, |g| g.row_bytes() as u64),
            up.row_bytes() as u64,
        );
        let down_unit = (d * down_dtype.bytes_for(unit)) as u64;
        let up_bias = m.segment(&names::layer(l, "ffn_up.bias")).is_some();
        Ok(FfnLayout {
            unit_bytes: unit as u64 * (gate_row + up_row) + down_unit,
            cost: ColdCost {
                decide_bytes: if gate.is_some() { gate_row } else { up_row },
                active_bytes: if gate.is_some() { up_row } else { 0 },
                unit_bytes: down_unit,
                unit,
            },
            tensors: 2 + gate.is_some() as u64 + up_bias as u64,
            kind: FfnKind::Matrices {
                gate_row,
                up_row,
                down: down_dtype,
                d_model: d,
                up_bias,
            },
        })
    }

    /// Device bytes of `hot` neurons' tensors, as the hybrid source allocates them.
    pub(super) fn device_bytes(&self, hot: usize) -> u64 {
        if hot == 0 {
            return 0;
        }
        let h = hot as u64;
        match self.kind {
            FfnKind::Bundles { row_bytes } => device_bytes(h * row_bytes),
            FfnKind::Matrices {
                gate_row,
                up_row,
                down,
                d_model,
                up_bias,
            } => {
                (if gate_row > 0 {
                    device_bytes(h * gate_row)
                } else {
                    0
                }) + device_bytes(h * up_row)
                    + device_bytes((d_model * down.bytes_for(hot)) as u64)
                    + if up_bias { device_bytes(h * 4) } else { 0 }
            }
        }
    }
}

/// Device bytes of layer `l`'s `hot` neurons as the hybrid source allocates them.
pub(super) fn hot_device_bytes(m: &Manifest, l: usize, hot: usize) -> Result<u64, PlanError> {
    Ok(FfnLayout::of(m, l)?.device_bytes(hot))
}

/// Room kept for the hot tensors' rounding to the granule, so the ILP's raw bytes always fit
/// once rounded.
pub(super) fn hot_rounding(layouts: &[FfnLayout]) -> u64 {
    layouts.iter().map(|f| f.tensors * DEVICE_ALIGN).sum()
}
