//! A mixture-of-experts prompt's time to first token under an [`ExpertPlan`]: the prompt runs in
//! steps of the plan's rows; in each step and layer the device computes attention and the
//! experts its unit holds, and the experts it lacks either stream through the device (steps of
//! at least [`ExpertPlan::stream_rows`]: copied in, then computed there) or the CPU computes
//! them from DRAM (with the SSD tier, those its cache lacks read first) while the device
//! computes its share. A step of `n` rows is taken to route to `E·(1 − (1 − k/E)ⁿ)` distinct
//! experts of a layer (uniformly), of which the unit holds its expected hit share.

use super::batch;
use super::cost::{PrefillPrediction, causal_attention_flops};
use super::experts::ExpertPlan;

impl ExpertPlan {
    /// Time to first token of a fresh prompt of `tokens`: the sum over steps and layers of the
    /// device's attention and the longer of its experts and the CPU's (or the stream's copies
    /// and compute), with the head and the ops' fixed cost.
    pub fn prefill_prediction(&self, tokens: usize) -> PrefillPrediction {
        let base = &self.plan;
        let spec = &base.spec;
        let hw = &base.hardware;
        let tokens = tokens.max(1);
        let group = base.prefill.group.clamp(1, self.batch.max(1));
        let steps = tokens.div_ceil(group);
        let (e, k) = (self.experts as f64, self.used as f64);
        let d_expert = spec.moe.as_ref().map_or(0, |m| m.d_expert);
        let expert_flops = 2.0 * 3.0 * (spec.d_model * d_expert) as f64;
        let cpu_rate = batch::cpu_flops_per_s(hw);
        let router_rows = spec.moe.as_ref().map_or(0, |m| m.router_rows());
        let trip = |bytes: f64| hw.op_overhead_s + bytes / hw.h2d_pinned_bytes_per_s;
        let (mut h2d, mut d2h) = (0f64, 0f64);
        let (mut pcie_s, mut compute_s, mut cpu_s, mut total_s) = (0f64, 0f64, 0f64, 0f64);
        let (mut flops, mut attention_flops) = (0f64, 0f64);
        for step in 0..steps {
            let n = group.min(tokens - step * group);
            let rows = n as f64;
            let distinct = if e > 0.0 {
                e * (1.0 - (1.0 - k / e).powi(n as i32))
            } else {
                0.0
            };
            let streams = self.stream_rows.is_some_and(|r| n >= r);
            for (l, layer) in self.layers.iter().enumerate() {
                let shape = &self.shapes[l];
                let eb = shape.bytes() as f64;
                let attn = causal_attention_flops(n, step * group, spec.q_dim());
                // Attention's projections and the router; each shared part is an expert.
                let proj = rows
                    * (batch::projection_flops(spec) + 2.0 * (spec.d_model * router_rows) as f64);
                let shared = rows * shape.shared as f64 * expert_flops;
                attention_flops += attn;
                let routed = rows * k * expert_flops;
                flops += attn + proj + shared + routed;
                let attention_s =
                    attn / hw.attention_rate() + (proj + shared) / hw.matmul_flops_per_s;
                let lacking = distinct * (1.0 - layer.hit_ratio);
                let held_share = if distinct > 0.0 {
                    1.0 - lacking / distinct
                } else {
                    1.0
                };
                // The FFN input and router logits come down each layer.
                d2h += rows * ((spec.d_model + router_rows) * 4) as f64;
                let experts_s = if lacking <= 0.0 {
                    routed / hw.matmul_flops_per_s
                } else if streams {
                    let bytes = lacking * eb;
                    h2d += bytes;
                    let copy = bytes / hw.h2d_pinned_bytes_per_s;
                    pcie_s += copy;
                    let compute = routed / hw.matmul_flops_per_s;
                    hw.together_s(copy, compute)
                } else {
                    let in_dram = match &self.host.dram_slots {
                        None => 1.0,
                        Some(ds) => ds[l] as f64 / e.max(1.0),
                    };
                    let ssd = lacking * (1.0 - in_dram) * eb / hw.ssd_read_bytes_per_s;
                    let cpu =
                        ssd + batch::bounded(
                            lacking * eb,
                            hw.dram_read_bytes_per_s,
                            1,
                            routed * (1.0 - held_share),
                            cpu_rate,
                        ) + trip(rows * (spec.d_model * 4) as f64);
                    h2d += rows * (spec.d_model * 4) as f64;
                    cpu_s += cpu;
                    cpu.max(routed * held_share / hw.matmul_flops_per_s)
                };
                compute_s += attention_s;
                total_s += attention_s + trip(0.0) + experts_s;
            }
        }
        let head = batch::head_flops(spec);
        flops += head;
        compute_s += head / hw.matmul_flops_per_s;
        total_s += head / hw.matmul_flops_per_s;
        d2h += (spec.vocab_size * 4) as f64;
        let ops_s = (steps * spec.n_layers * 16 + 4) as f64 * hw.op_overhead_s;
        let limited_by = if cpu_s >= pcie_s && cpu_s >= compute_s {
            "the CPU's experts"
        } else if pcie_s >= compute_s {
            "PCIe (streamed experts)"
        } else {
            "compute"
        };
        PrefillPrediction {
            tokens,
            groups: steps,
            h2d_bytes: h2d as u64,
            d2h_bytes: d2h as u64,
            flops,
            attention_flops,
            pcie_s,
            compute_s,
            cpu_s,
            ops_s,
            ttft_s: total_s + ops_s,
            limited_by: limited_by.into(),
        }
    }
}
