//! Decode steps of several sequences (continuous batching: `plan --parallel N`, `bench decode
//! --sessions N`, `serve --parallel N`): one step evaluates a token of each of N sequences, so
//! what is read once per step (resident and streamed weights, the CPU's FFN rows, the deciding
//! vectors of cold neurons) serves all N, while what belongs to a row grows with N: each
//! sequence's KV cache, its input and output vectors, and every product's FLOPs. The pieces every
//! mode's cost model takes to predict the aggregate tokens/s of N sequences (N ÷ a step's
//! seconds).
//!
//! - One row is a matrix-vector product whose time its bytes give (the kernels are memory-bound
//!   there, as the single-sequence predictions always took them). From two rows on, a resource's
//!   time is also at least the step's FLOPs ÷ its rate ([`bounded`]).
//! - The CPU kernels (`backend::cpu::sparse`) read four neurons at a time and compute them for
//!   every row of the step from cache: bytes once, FLOPs N times. So the CPU's time for its
//!   share is `max(bytes ÷ DRAM rate, N × a row's FLOPs ÷ the CPU's rate)`
//!   ([`cpu_flops_per_s`]), which is what makes the split's CPU share shrink as N grows.
//! - Sparse modes: a neuron active with probability `p` for one sequence is needed by the step
//!   with probability `1 − (1 − p)^N` (sequences taken as independent): the union the step reads,
//!   copies and computes ([`union_share`]).
//!
//! Closed-form arithmetic; no failure.

use crate::footprint::{CPU_ATTENTION_ROWS, PrefillLayout};
use crate::model::ModelSpec;

use super::budget::Budget;
use super::hardware::HardwareProfile;

/// FLOP/s of the CPU per byte/s of its DRAM read rate, where the profile does not state the
/// CPU's rate (a GPU host: `doctor` measures its DRAM, not its arithmetic). From the one
/// measurement there is (H100 host, 7B f16 at `--gpu-mem 4G`, the split planned for one
/// sequence: 102 ms a step alone, 483 ms for 16, streaming alone at 5.07 tok/s, i.e. PCIe about
/// 55 GB/s): each added sequence cost about a quarter of the one-sequence step, so the CPU
/// computed its f16 rows (one FLOP a byte) at 3–4× the DRAM rate the balance implies; the
/// lower end is taken, so the split is not over-sold at large batches.
pub const CPU_FLOPS_PER_DRAM_BYTE: f64 = 3.0;

/// Rows one decode step of the plan evaluates: a token of each of the budget's sequences, at
/// most as many as a step holds (more sequences take several steps of that many).
pub fn step_rows(budget: &Budget, layout: &PrefillLayout) -> usize {
    budget.sequences.clamp(1, layout.group.max(1))
}

/// Whether a decode step of `rows` rows attends on the CPU (a KV cache in host memory, attended
/// where it lies for steps of a few rows; longer steps bring it to the device).
pub fn attends_on_cpu(layout: &PrefillLayout, rows: usize) -> bool {
    layout.kv_host && layout.cpu_attention && rows <= CPU_ATTENTION_ROWS
}

/// FLOP/s the CPU computes FFN neurons at: the budgeted device's measured product rate where the
/// device is the CPU (its "device memory" no faster than host memory), else
/// [`CPU_FLOPS_PER_DRAM_BYTE`] × the DRAM read rate.
pub fn cpu_flops_per_s(hw: &HardwareProfile) -> f64 {
    if hw.hbm_bytes_per_s <= hw.dram_read_bytes_per_s {
        hw.matmul_flops_per_s
    } else {
        CPU_FLOPS_PER_DRAM_BYTE * hw.dram_read_bytes_per_s
    }
}

/// Seconds a resource takes for a step of `rows` rows: its `bytes` at `bytes_per_s` and, from
/// two rows on, at least `rows × flops_per_row` at `flops_per_s`.
pub fn bounded(
    bytes: f64,
    bytes_per_s: f64,
    rows: usize,
    flops_per_row: f64,
    flops_per_s: f64,
) -> f64 {
    bounded_read(bytes / bytes_per_s, rows, flops_per_row, flops_per_s)
}

/// [`bounded`] for a resource whose reads take `read` seconds.
pub fn bounded_read(read: f64, rows: usize, flops_per_row: f64, flops_per_s: f64) -> f64 {
    if rows > 1 {
        read.max(rows as f64 * flops_per_row / flops_per_s)
    } else {
        read
    }
}

/// Reads the CPU starts for each whole bundle it computes: the gate and up parts, side by side,
/// in one; the down part, read by the down pass, in another (hybrid's whole cold bundles are
/// counted so too: a read per candidate, another per active neuron).
pub const BUNDLE_READS: f64 = 2.0;

/// Bytes per second the CPU reads whole FFN bundles of `neuron_bytes` bytes at: their bytes at
/// the DRAM rate and [`BUNDLE_READS`] read starts each
/// ([`HardwareProfile::cpu_sparse_seconds`]: the split's rows run hybrid's kernels, which
/// measured 0.4–0.5 of the DRAM rate on SmolLM2's 3,456-byte bundles).
pub fn bundle_read_rate(hw: &HardwareProfile, neuron_bytes: u64) -> f64 {
    if neuron_bytes == 0 {
        return hw.dram_read_bytes_per_s;
    }
    let b = neuron_bytes as f64;
    b / hw.cpu_sparse_seconds(b, BUNDLE_READS)
}

/// Bytes per second the CPU gets through whole FFN bundles of `neuron_bytes` bytes and `flops`
/// FLOPs a row ([`neuron_flops`]) in a step of `rows` rows: [`bundle_read_rate`], or less where
/// computing every row takes longer than reading.
pub fn cpu_neuron_rate(hw: &HardwareProfile, flops: f64, neuron_bytes: u64, rows: usize) -> f64 {
    let d = bundle_read_rate(hw, neuron_bytes);
    if rows <= 1 || neuron_bytes == 0 {
        return d;
    }
    let per_neuron_s = rows as f64 * flops / cpu_flops_per_s(hw);
    d.min(neuron_bytes as f64 / per_neuron_s)
}

/// Share of a step's neurons needed when each is active with probability `p` for one sequence:
/// `1 − (1 − p)^rows`.
pub fn union_share(p: f64, rows: usize) -> f64 {
    if rows <= 1 {
        return p;
    }
    1.0 - (1.0 - p.clamp(0.0, 1.0)).powi(rows as i32)
}

/// A predicted speed as reports print it: tokens/s, and for several sequences the aggregate and
/// each sequence's share.
pub fn speed(tokens_per_s: f64, sequences: usize) -> String {
    if sequences > 1 {
        format!(
            "{tokens_per_s:.1} tok/s in all for {sequences} sequences ({:.2} each)",
            tokens_per_s / sequences as f64
        )
    } else {
        format!("{tokens_per_s:.1} tok/s")
    }
}

/// FLOPs of one FFN neuron for one row (gate, up and down, or up and down: a multiply-add per
/// weight).
pub fn neuron_flops(spec: &ModelSpec) -> f64 {
    let mats = if spec.gated_ffn { 3 } else { 2 };
    2.0 * (mats * spec.d_model) as f64
}

/// FLOPs of one layer's attention projections (Q, K, V, O) for one row.
pub fn projection_flops(spec: &ModelSpec) -> f64 {
    2.0 * (spec.d_model * (2 * spec.q_dim() + 2 * spec.kv_dim())) as f64
}

/// FLOPs of one layer's attention for one row over `context` positions (scores and sums).
pub fn attention_flops(spec: &ModelSpec, context: usize) -> f64 {
    4.0 * (spec.q_dim() * context) as f64
}

/// FLOPs of the output matrix for one row.
pub fn head_flops(spec: &ModelSpec) -> f64 {
    2.0 * (spec.d_model * spec.vocab_size) as f64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::hardware::presets;

    #[test]
    fn one_row_is_its_bytes_and_more_rows_are_at_least_their_flops() {
        assert_eq!(bounded(100.0, 10.0, 1, 1e9, 1.0), 10.0);
        assert_eq!(bounded(100.0, 10.0, 2, 1.0, 1.0), 10.0);
        assert_eq!(bounded(100.0, 10.0, 4, 5.0, 1.0), 20.0);
    }

    #[test]
    fn the_union_of_active_neurons_grows_with_the_rows() {
        assert_eq!(union_share(0.3, 1), 0.3);
        assert!((union_share(0.5, 2) - 0.75).abs() < 1e-12);
        assert_eq!(union_share(0.0, 64), 0.0);
        assert_eq!(union_share(1.0, 64), 1.0);
        let mut last = 0.0;
        for n in 1..=64 {
            let u = union_share(0.05, n);
            assert!(u > last && u <= 1.0, "{n}: {u}");
            last = u;
        }
    }

    #[test]
    fn the_cpu_gets_through_fewer_bytes_a_second_as_rows_grow() {
        let hw = presets().into_iter().find(|p| p.name == "cpu-sim").unwrap();
        // A gated neuron of d_model 576 in f16: 3 × 576 weights, 2 FLOPs each.
        let (b, f) = (3 * 576 * 2, 2.0 * 3.0 * 576.0);
        assert_eq!(cpu_neuron_rate(&hw, f, b, 1), hw.dram_read_bytes_per_s);
        let mut last = f64::INFINITY;
        for rows in [1, 2, 4, 16, 64] {
            let r = cpu_neuron_rate(&hw, f, b, rows);
            assert!(r <= last, "{rows} rows: {r} B/s");
            last = r;
        }
        assert!(last < hw.dram_read_bytes_per_s / 4.0);
    }
}
