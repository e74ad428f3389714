//! The cost model: what each resource moves for a decoded token under a streaming plan and the
//! tokens/s that predicts (the slowest of PCIe, SSD, device memory and the CPU's share bounds
//! it, plus each op's fixed cost), and a prompt's time to first token
//! ([`Plan::prefill_prediction`]).
//!
//! Closed-form arithmetic on the plan's bytes and the hardware profile's rates: no search, no
//! failure. Where the KV cache lives in host memory, decode attends on the CPU when the CPU
//! reads it faster than PCIe brings it.

use serde::Serialize;

use crate::footprint::{PrefillLayout, kv_bytes};
use crate::model::ModelSpec;

use super::batch;
use super::budget::Budget;
use super::hardware::HardwareProfile;
use super::preserve::{LayerShape, Part, Residency};
use super::{DecodeStep, PerToken, Plan, Prediction};

/// What a decoded token's cost follows from: the placement a streaming plan chose.
pub(super) struct DecodeInputs<'a> {
    /// Every layer's row shape, and the widest.
    pub(super) shapes: &'a [LayerShape],
    pub(super) shape: LayerShape,
    pub(super) residency: Residency,
    pub(super) prefill: PrefillLayout,
    /// Device bytes of the small fragments and of the output matrix.
    pub(super) small: u64,
    pub(super) head: u64,
    /// One session's KV cache on the device.
    pub(super) per_session: u64,
    /// Bytes read from SSD per token (the dynamic layers' streamed rows).
    pub(super) ssd_bytes: u64,
    /// Bytes of every layer's FFN rows the CPU computes (the split; 0 without).
    pub(super) cpu_rows: u64,
    /// The prefetch window: slots for streamed layers (0: every layer resident).
    pub(super) window: usize,
}

/// The split's copies up of one decode token where the CPU computes FFN rows (`cpu_rows` bytes
/// of them): every layer's sum, which the CPU continued, back to the device, `n_layers ×
/// d_model` f32. Down go twice as many: the FFN input and the device's sum
/// ([`SPLIT_DOWN_VECTORS`]).
/// Vectors the split copies device→host per layer and token (the FFN input, the device's sum)
/// for every one it copies back.
pub(super) const SPLIT_DOWN_VECTORS: u64 = 2;

pub(super) fn split_trip_bytes(spec: &ModelSpec, cpu_rows: u64) -> u64 {
    if cpu_rows > 0 {
        (spec.n_layers * spec.d_model * 4) as u64
    } else {
        0
    }
}

/// [`decode_cost`]: the prefill layout with where decode attends decided, and what a token
/// moves and takes.
pub(super) struct DecodeCost {
    pub(super) prefill: PrefillLayout,
    pub(super) per_token: PerToken,
    pub(super) prediction: Prediction,
}

/// Per decoded token: streamed layers + the input row in; logits out; the dynamic layers
/// from SSD; device compute reads every weight and half the KV cache on average. A step of the
/// budget's sequences reads the weights (and the CPU its rows) once for all of them, and every
/// sequence's input, KV cache and FLOPs ([`super::batch`]); the prediction is their aggregate.
pub(super) fn decode_cost(
    spec: &ModelSpec,
    budget: &Budget,
    hw: &HardwareProfile,
    placed: &DecodeInputs,
) -> DecodeCost {
    let DecodeInputs {
        shapes,
        shape,
        residency,
        prefill,
        small,
        head,
        per_session,
        ssd_bytes,
        cpu_rows,
        window,
    } = *placed;
    let n_layers = spec.n_layers;
    let streamed_all: u64 = shapes.iter().map(|sh| residency.streamed_bytes(sh)).sum();
    // A KV cache in host memory is read for every token, half the context on average: over
    // PCIe, a layer at a time, or by the CPU from DRAM (the token's q, k, v down and the
    // attention output up) — whichever is faster (the bytes are the same): the CPU at the rate
    // it attends (measured by `doctor`, else the DRAM read rate).
    let mut prefill = prefill;
    prefill.cpu_attention = prefill.kv_host && hw.cpu_attention_rate() >= hw.h2d_pinned_bytes_per_s;
    // Where one row of a step of `rows` attends: the KV it brings in, the KV the CPU reads, the
    // rows crossing for CPU attention.
    let attention_of = |rows: usize| {
        let layout = PrefillLayout {
            cpu_attention: batch::attends_on_cpu(&prefill, rows),
            ..prefill
        };
        let (kv_in, kv_cpu) = host_kv_per_row(spec, budget, &prefill, rows);
        (kv_in, kv_cpu, cpu_attention_rows(spec, layout))
    };
    let (kv_in, kv_cpu, (rows_in, rows_out)) = attention_of(1);
    let device_weights =
        small + head + shapes.iter().map(LayerShape::total).sum::<u64>() - cpu_rows;
    let split_trip = split_trip_bytes(spec, cpu_rows);
    let per_token = PerToken {
        h2d_bytes: streamed_all + spec.d_model as u64 * 4 + kv_in + rows_in + split_trip,
        d2h_bytes: spec.vocab_size as u64 * 4
            + kv_row_out(spec, budget, prefill)
            + rows_out
            + SPLIT_DOWN_VECTORS * split_trip,
        ssd_bytes,
        hbm_read_bytes: device_weights + per_session / 2,
        cpu_read_bytes: cpu_rows + kv_cpu,
    };
    // Ops per token: per layer about 14 (norms, 4 projections, rope, attention, FFN, adds)
    // plus one per streamed block; one op runs every row of a step.
    let streamed_blocks = Part::ALL
        .iter()
        .filter(|&&p| !residency.streamed_rows(&shape, p).is_empty())
        .count();
    let ops = n_layers * (14 + streamed_blocks) + 4;
    let rows = batch::step_rows(budget, &prefill);
    let (kv_in_r, kv_cpu_r, (rows_in_r, _)) = attention_of(rows);
    let r = rows as u64;
    let h2d = streamed_all + r * (spec.d_model as u64 * 4 + kv_in_r + rows_in_r);
    let step = decode_step(
        spec,
        budget,
        hw,
        (placed, &prefill),
        rows,
        (h2d, device_weights),
    );
    let pcie_s = h2d as f64 / hw.h2d_pinned_bytes_per_s;
    let ssd_s = per_token.ssd_bytes as f64 / hw.ssd_read_bytes_per_s;
    let hbm_s = step.hbm_read_bytes as f64 / hw.hbm_bytes_per_s;
    let ops_s = ops as f64 * hw.op_overhead_s;
    // The CPU's share runs between the device's ops of its layer: serial with them, overlapping
    // the copies; each layer pays three copies (the FFN input and the device's sum down, the
    // continued sum up, a row of each per sequence). Its rows are read once a step and
    // computed for every sequence.
    let cpu_s = r as f64 * kv_cpu_r as f64 / hw.cpu_attention_rate()
        + if cpu_rows > 0 {
            let vector = (rows * spec.d_model * 4) as f64;
            batch::bounded(
                cpu_rows as f64,
                batch::bundle_read_rate(hw, shape.row_bytes[Part::Ffn.index()]),
                rows,
                step.cpu_flops / rows as f64,
                batch::cpu_flops_per_s(hw),
            ) + n_layers as f64
                * (1 + SPLIT_DOWN_VECTORS) as f64
                * (hw.op_overhead_s + vector / hw.h2d_pinned_bytes_per_s)
        } else {
            0.0
        };
    let device_s = hbm_s.max(step.compute_s);
    let device = if step.compute_s > hbm_s {
        "compute"
    } else {
        "HBM"
    };
    // One slot: the next layer's copy waits for this layer's compute to free it, and its
    // compute for the copy; with two or more, copies run ahead beside the compute.
    let in_turn = hw.copies_share_memory || window == 1;
    let (limited_by, bound) = decode_bound(in_turn, (pcie_s, ssd_s, cpu_s), (device, device_s));
    let prediction = Prediction {
        tokens_per_s: rows as f64 / (bound + ops_s),
        limited_by: limited_by.to_string(),
        pcie_s,
        ssd_s,
        hbm_s,
        cpu_s,
        ops_s,
        step,
    };
    DecodeCost {
        prefill,
        per_token,
        prediction,
    }
}

/// What bounds a decode step whose link, SSD and CPU take `pcie_s`, `ssd_s` and `cpu_s` and
/// whose device takes `device_s` (limited by `device`: its memory or its compute), and for
/// how long: the longest of them, the device with the CPU's share serial with it, and where
/// copies and compute take turns (`in_turn`) their sum, the CPU's share with them. They take
/// turns where copies and device reads share one memory (see
/// `HardwareProfile::copies_share_memory`: the budgeted device's kernels and copies run on the
/// CPU that computes it; SmolLM2's split at 48M: link 4.3, CPU 6.1 and device 4.7 ms of a
/// 15.2 ms step), and where a window of one slot makes each copy wait for the compute before.
fn decode_bound(
    in_turn: bool,
    (pcie_s, ssd_s, cpu_s): (f64, f64, f64),
    (device, device_s): (&'static str, f64),
) -> (&'static str, f64) {
    let shared_s = if in_turn {
        pcie_s + device_s + cpu_s
    } else {
        0.0
    };
    [
        ("PCIe", pcie_s),
        ("SSD", ssd_s),
        (device, device_s),
        (
            if device == "HBM" {
                "HBM+CPU"
            } else {
                "compute+CPU"
            },
            device_s + cpu_s,
        ),
        (
            if cpu_s > 0.0 {
                "PCIe+HBM+CPU"
            } else {
                "PCIe+HBM"
            },
            shared_s,
        ),
    ]
    .into_iter()
    .fold(
        ("HBM", 0.0),
        |acc, (n, t)| if t > acc.1 { (n, t) } else { acc },
    )
}

/// A decode step of `rows` rows under a streaming plan (`placed`, with the prefill layout where
/// decode attends decided): the device reads its weights once and each row's KV (half the
/// context on average); FLOPs of every row, the device's (the products of what it holds or
/// streams, and attention) and the CPU's (its FFN rows). `bytes`: (host→device, weights the
/// device reads) of the step.
fn decode_step(
    spec: &ModelSpec,
    budget: &Budget,
    hw: &HardwareProfile,
    (placed, prefill): (&DecodeInputs, &PrefillLayout),
    rows: usize,
    bytes: (u64, u64),
) -> DecodeStep {
    let n_layers = spec.n_layers as f64;
    let cpu_neurons = if placed.cpu_rows > 0 {
        placed.residency.cpu_rows
    } else {
        0
    };
    let device_neurons = spec.d_ff.saturating_sub(cpu_neurons) as f64;
    let on_cpu = batch::attends_on_cpu(prefill, rows);
    let attention = if on_cpu {
        0.0
    } else {
        batch::attention_flops(spec, budget.ctx / 2)
    };
    let device_row = n_layers
        * (batch::projection_flops(spec) + attention + device_neurons * batch::neuron_flops(spec))
        + batch::head_flops(spec);
    let cpu_row = n_layers * cpu_neurons as f64 * batch::neuron_flops(spec);
    let r = rows as u64;
    let hbm_read_bytes = bytes.1 + r * placed.per_session / 2;
    let compute_s = if rows > 1 {
        rows as f64 * device_row / hw.matmul_flops_per_s
    } else {
        0.0
    };
    let (_, kv_cpu) = host_kv_per_row(spec, budget, prefill, rows);
    DecodeStep {
        sequences: rows,
        h2d_bytes: bytes.0,
        hbm_read_bytes,
        cpu_read_bytes: placed.cpu_rows + r * kv_cpu,
        device_flops: rows as f64 * device_row,
        cpu_flops: rows as f64 * cpu_row,
        compute_s,
    }
}

/// FLOPs of causal attention for one layer: `rows` query rows at positions `context..`, each
/// scoring and summing (2 FLOPs a multiply-add, both products) every position up to its own,
/// over `q_dim` query columns (heads × head dim).
pub fn causal_attention_flops(rows: usize, context: usize, q_dim: usize) -> f64 {
    let (rows, context) = (rows as f64, context as f64);
    4.0 * q_dim as f64 * (rows * context + rows * (rows + 1.0) / 2.0)
}

/// The KV bytes one row of a decode step of `rows` rows moves, every layer, where `prefill`
/// keeps the cache in host memory (half the context on average): `(brought in over the link,
/// read by the CPU where it attends there)`; none where the cache is on the device.
pub(super) fn host_kv_per_row(
    spec: &ModelSpec,
    budget: &Budget,
    prefill: &PrefillLayout,
    rows: usize,
) -> (u64, u64) {
    if !prefill.kv_host {
        return (0, 0);
    }
    let mid = kv_bytes(spec, budget.ctx, budget.kv_type) / 2;
    if batch::attends_on_cpu(prefill, rows) {
        (0, mid)
    } else {
        (mid, 0)
    }
}

/// What a decode step of a plan moves for its KV cache where the plan keeps it in host memory
/// (every layer, every row; none where it is on the device): the bytes the link brings in, or
/// those the CPU reads where it attends there, and the seconds that reading takes.
pub(super) struct HostKv {
    pub(super) link: u64,
    pub(super) cpu: u64,
    pub(super) cpu_s: f64,
}

impl HostKv {
    /// For a decode step of `rows` rows under `plan`.
    pub(super) fn of(plan: &Plan, rows: usize) -> Self {
        let (link, cpu) = host_kv_per_row(&plan.spec, &plan.budget, &plan.prefill, rows);
        let (link, cpu) = (rows as u64 * link, rows as u64 * cpu);
        HostKv {
            link,
            cpu,
            cpu_s: cpu as f64 / plan.hardware.cpu_attention_rate(),
        }
    }
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
    /// The CPU's share (a mixture-of-experts prompt's missed experts), beside the device's.
    pub cpu_s: f64,
    pub ops_s: f64,
    pub ttft_s: f64,
    pub limited_by: String,
}

impl Plan {
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
            cpu_s: 0.0,
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
