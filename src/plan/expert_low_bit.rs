//! Mixed-precision experts (HOBBIT's low-bit misses), off unless asked
//! (`--expert-low-bit FORMAT`): in a decode step (at most [`LOW_BIT_ROWS`] rows), a routed
//! expert the device's unit lacks and that is not its token's most weighted is computed on the
//! device from a low-bit copy — every routed expert's copy kept in host memory in that format,
//! quantized at load, the step's copied into a low-bit area on the device — while the CPU
//! computes the token's top experts the unit lacks at full precision. Both resources work a
//! step at once: the CPU reads fewer experts, the bus carries smaller ones. What it costs in
//! perplexity is measured with `perplexity --expert-low-bit` beside the same run without.

use serde::Serialize;

use super::budget::PlanError;
use super::expert_host::host_bytes;
use super::expert_shape::ExpertShape;
use crate::footprint::device_bytes;
use crate::tensor::DType;

/// Steps of at most this many rows send their low-ranked misses to the low-bit area (a
/// prompt's steps stream or leave them to the CPU at full precision).
pub const LOW_BIT_ROWS: usize = 8;

/// The low-bit copies' place in the plan.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LowBitExperts {
    pub dtype: DType,
    /// Experts the device's low-bit area holds (a step's low-ranked misses at most).
    pub slots: usize,
    /// Device bytes of the area (per matrix, as wide as its widest layer's) and of the buffer
    /// of `rows` rows its experts' sum comes into.
    pub area: u64,
    pub rows: usize,
    pub out: u64,
    /// Host bytes of every routed expert's low-bit copy.
    pub dram: u64,
    /// Per layer, one expert's low-bit bytes (its three matrices).
    pub expert_bytes: Vec<u64>,
}

impl LowBitExperts {
    /// Device bytes of the area and its output buffer.
    pub fn device_bytes(&self) -> u64 {
        self.area + self.out
    }
}

/// The low-bit plan for experts of `shapes` (`experts` routed, `used` a token) in `dtype`, for
/// steps of up to `batch` rows of `d_model`.
pub fn plan_low_bit(
    shapes: &[ExpertShape],
    (experts, used): (usize, usize),
    (batch, d_model): (usize, usize),
    dtype: DType,
) -> Result<LowBitExperts, PlanError> {
    if !dtype.is_quantized() {
        return Err(PlanError::Budget(format!(
            "--expert-low-bit {}: a block format is needed (q4_0, q3_k, q2_k, ...)",
            dtype.name()
        )));
    }
    for (l, s) in shapes.iter().enumerate() {
        if let Some((_, cols)) = s
            .dims
            .iter()
            .find(|(_, c)| !c.is_multiple_of(dtype.block_len()))
        {
            return Err(PlanError::Budget(format!(
                "--expert-low-bit {}: layer {l}'s experts have rows of {cols} values, not whole blocks of {}",
                dtype.name(),
                dtype.block_len()
            )));
        }
    }
    let matrix = |s: &ExpertShape, i: usize| -> u64 {
        let (rows, cols) = s.dims[i];
        (rows * dtype.bytes_for(cols)) as u64
    };
    let slots = (used.saturating_sub(1) * LOW_BIT_ROWS.min(batch.max(1))).clamp(1, experts.max(1));
    let area = (0..3)
        .map(|i| {
            device_bytes(slots as u64 * shapes.iter().map(|s| matrix(s, i)).max().unwrap_or(0))
        })
        .sum();
    let dram = shapes
        .iter()
        .map(|s| {
            (0..3)
                .map(|i| host_bytes(experts as u64 * matrix(s, i)))
                .sum::<u64>()
        })
        .sum();
    Ok(LowBitExperts {
        dtype,
        slots,
        area,
        rows: LOW_BIT_ROWS.min(batch.max(1)),
        out: device_bytes((LOW_BIT_ROWS.min(batch.max(1)) * d_model * 4) as u64),
        dram,
        expert_bytes: shapes
            .iter()
            .map(|s| (0..3).map(|i| matrix(s, i)).sum())
            .collect(),
    })
}

/// Of a layer's `k` routed experts a token, the share that is not its most weighted: what a
/// unit's misses send to the low-bit area.
pub fn low_ranked_share(used: usize) -> f64 {
    if used == 0 {
        0.0
    } else {
        (used - 1) as f64 / used as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(rows: usize, cols: usize) -> ExpertShape {
        ExpertShape {
            gate: 0,
            up: 0,
            down: 0,
            shared: 0,
            router: 0,
            read_extent: 0,
            dims: [(rows, cols), (rows, cols), (cols, rows)],
        }
    }

    #[test]
    fn low_bit_copies_are_block_formats_of_whole_blocks() {
        let shapes = [shape(256, 512), shape(256, 512)];
        let p = plan_low_bit(&shapes, (8, 2), (1, 512), DType::Q4_0).unwrap();
        // One row a step: one low-ranked expert; each matrix 256 rows of 512 in Q4_0 (18 bytes
        // per 32 values).
        assert_eq!(p.slots, 1);
        let m = (256 * 512 / 32 * 18) as u64;
        assert_eq!(p.expert_bytes, vec![3 * m, 3 * m]);
        assert_eq!(p.dram, 2 * 3 * host_bytes(8 * m));
        // Eight rows: up to 8 low-ranked experts of 8.
        assert_eq!(
            plan_low_bit(&shapes, (8, 2), (64, 512), DType::Q4_0)
                .unwrap()
                .slots,
            8
        );
        assert!(plan_low_bit(&shapes, (8, 2), (1, 512), DType::F16).is_err());
        // Q2_K blocks are 256 values: rows of 512 are whole, rows of 128 are not.
        assert!(plan_low_bit(&shapes, (8, 2), (1, 512), DType::Q2K).is_ok());
        let e = plan_low_bit(&[shape(512, 128)], (8, 2), (1, 512), DType::Q2K).unwrap_err();
        assert!(e.to_string().contains("whole blocks of 256"), "{e}");
        assert_eq!(low_ranked_share(8), 7.0 / 8.0);
    }
}
