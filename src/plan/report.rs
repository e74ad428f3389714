//! The plan as a table: per layer where its bytes live, then totals against the budgets and the
//! predicted speed with the bound behind it.
//!
//! Formatting only: every figure comes from the [`Plan`] (and its
//! [`Plan::prefill_prediction`]); nothing is decided here.

use std::fmt::Write;

use super::Plan;
use super::preserve::Part;

impl Plan {
    /// The per-layer table and totals, for people.
    pub fn report(&self) -> String {
        render(self)
    }
}

fn mib(b: u64) -> String {
    format!("{:.1}", b as f64 / (1u64 << 20) as f64)
}

fn render(p: &Plan) -> String {
    let mut o = String::new();
    write_header(&mut o, p);
    write_layers(&mut o, p);
    write_gpu(&mut o, p);
    write_prefill(&mut o, p);
    write_dram(&mut o, p);
    write_decode(&mut o, p);
    o
}

/// The model, the budget and the hardware; the rows every layer keeps resident.
fn write_header(o: &mut String, p: &Plan) {
    let spec = &p.spec;
    let _ = writeln!(
        o,
        "model {} ({}), {} layers, d {}, FFN {}, model id {}",
        p.model,
        match spec.arch {
            crate::model::Arch::Llama => "llama",
            crate::model::Arch::Opt => "opt",
        },
        spec.n_layers,
        spec.d_model,
        spec.d_ff,
        p.model_id
    );
    let _ = writeln!(
        o,
        "budget: GPU {} MiB, DRAM {}, prefetch window {} layers, context {} tokens, batch {}; hardware {}",
        mib(p.budget.gpu_mem),
        p.budget
            .dram_mem
            .map_or("unlimited".into(), |d| format!("{} MiB", mib(d))),
        if p.streams() && p.window < p.budget.window {
            format!(
                "{} (of {} asked: the budget holds no more)",
                p.window, p.budget.window
            )
        } else {
            p.budget.window.to_string()
        },
        p.budget.ctx,
        p.budget.batch,
        match &p.hardware.rates_source {
            Some(src) => format!("{}; rates {src}", p.hardware.name),
            None => p.hardware.name.clone(),
        }
    );
    let kept: Vec<String> = Part::ALL
        .iter()
        .filter(|&&q| p.shape.rows[q.index()] > 0)
        .map(|&q| {
            let (r, n) = (p.residency.rows[q.index()], p.shape.rows[q.index()]);
            let cpu = p.residency.cpu_rows_of(&p.shape, q).len();
            if cpu > 0 {
                format!("{} {r}/{n} (the last {cpu} on the CPU)", q.name())
            } else {
                format!("{} {r}/{n}", q.name())
            }
        })
        .collect();
    let _ = writeln!(
        o,
        "resident rows in every layer (balanced): {}",
        kept.join(", ")
    );
    let _ = writeln!(o);
}

/// Per layer: how it runs, its resident, streamed and CPU bytes, its DRAM area and SSD reads.
fn write_layers(o: &mut String, p: &Plan) {
    let spec = &p.spec;
    let _ = writeln!(
        o,
        "{:>5}  {:>9}  {:>13}  {:>13}  {:>8}  {:>8}  {:>14}",
        "layer", "runs", "resident MiB", "streamed MiB", "CPU MiB", "DRAM", "SSD MiB/token"
    );
    let cpu = p.residency.cpu_bytes(&p.shape);
    let streamed = p.streamed_bytes_per_layer;
    // What each layer's weights do per token: read where they rest, copied in, or (the split's
    // FFN rows) computed by the CPU beside the copies.
    let runs = match (streamed > 0, cpu > 0) {
        _ if p.residency.ffn_off && p.budget.unit_reserve.is_some() => "units",
        _ if p.residency.ffn_off => "hybrid",
        (false, false) => "resident",
        (true, false) => "streamed",
        (_, true) => "split",
    };
    for l in 0..spec.n_layers {
        let (area, ssd) = if !p.streams() {
            ("-", 0)
        } else if l < p.dram.fixed_layers {
            ("fixed", 0)
        } else {
            ("dynamic", p.dram.layer_bytes)
        };
        let _ = writeln!(
            o,
            "{:>5}  {:>9}  {:>13}  {:>13}  {:>8}  {:>8}  {:>14}",
            l,
            runs,
            mib(p.resident_bytes_per_layer),
            mib(streamed),
            mib(cpu),
            area,
            mib(ssd)
        );
    }
}

/// Device memory by use against `--gpu-mem`.
fn write_gpu(o: &mut String, p: &Plan) {
    let g = &p.gpu;
    let _ = writeln!(o);
    let _ = writeln!(
        o,
        "GPU  {} MiB of {} MiB: fixed cost {} (context, kernels, cuBLAS), resident layers {}, streaming slots {} ({} × {}), output matrix {}, small fragments {}, KV cache {} ({}, {}), step buffers {}, workspace {}{}",
        mib(g.total),
        mib(p.budget.gpu_mem),
        mib(g.fixed),
        mib(g.resident_layers),
        mib(g.slots),
        p.window,
        mib(p.streamed_bytes_per_layer),
        mib(g.head),
        mib(g.small),
        mib(g.kv),
        match p.budget.kv_pool.filter(|_| !p.prefill.kv_host) {
            Some(blocks) => format!(
                "a pool of {} positions for {} sequences",
                blocks * crate::backend::KV_BLOCK,
                p.budget.sessions
            ),
            None => format!("{} × {} positions", p.budget.sessions, p.budget.ctx),
        },
        p.budget.kv_type.name(),
        mib(g.scratch),
        mib(g.workspace),
        // Streamed attention's reserve is not in the total: what is placed in it is listed
        // below, and without it the budget would read as partly unused. Cache units also keep
        // a second step's buffers free (`units::unit_room`: steps of another size reallocate
        // theirs, and an exactly filled budget has its free bytes in pieces too small).
        match (p.budget.unit_reserve, p.budget.hot_reserve) {
            (Some(r), _) if r > 0 => format!(
                "; beside these, {} MiB kept free for the cache units and their staging (below) and {} MiB for step buffers of another size",
                mib(r),
                mib(g.scratch)
            ),
            (_, Some(r)) if r > 0 => {
                format!(
                    "; beside these, {} MiB kept free for the hot neurons (below)",
                    mib(r)
                )
            }
            _ => String::new(),
        }
    );
}

/// How the longest prompt runs and its predicted time to first token.
fn write_prefill(o: &mut String, p: &Plan) {
    if p.spec.moe.is_some() {
        // Its experts' plan predicts a MoE prompt (`ExpertPlan::prefill_prediction`).
        return;
    }
    let pf = p.prefill;
    let prompt = p.budget.prompt.max(1);
    let pp = p.prefill_prediction(prompt);
    let _ = writeln!(
        o,
        "prefill of {prompt} tokens: {}, KV cache {}; predicted TTFT {:.3} s ({}: host→device {} MiB, device→host {} MiB, {:.3} s at {:.1} GB/s; {:.2} TFLOP, {:.3} s: products {:.2} TFLOP at {:.1} TFLOP/s, attention {:.2} TFLOP at {:.1} TFLOP/s{}; ops {:.3} s)",
        if pf.partitions(prompt) {
            format!(
                "{} groups of {} rows per layer, each layer's weights once, hidden states {}",
                pp.groups,
                pf.group,
                if pf.residual_on_device(prompt) {
                    "on the device"
                } else {
                    "in host memory"
                }
            )
        } else {
            format!("one step (steps of up to {} rows)", pf.group)
        },
        if pf.kv_host && pf.cpu_attention {
            format!(
                "in host memory, a layer at a time on the device for prefill; decode attends on \
                 the CPU (at {:.1} GB/s of KV cache, {})",
                p.hardware.cpu_attention_rate() / 1e9,
                if p.hardware.cpu_attention_bytes_per_s.is_some() {
                    "measured"
                } else {
                    "the DRAM read rate: not measured"
                }
            )
        } else if pf.kv_host {
            "in host memory, a layer at a time on the device".into()
        } else {
            "on the device".into()
        },
        pp.ttft_s,
        pp.limited_by,
        mib(pp.h2d_bytes),
        mib(pp.d2h_bytes),
        pp.pcie_s,
        p.hardware.h2d_pinned_bytes_per_s / 1e9,
        pp.flops / 1e12,
        pp.compute_s,
        (pp.flops - pp.attention_flops) / 1e12,
        p.hardware.matmul_flops_per_s / 1e12,
        pp.attention_flops / 1e12,
        p.hardware.attention_rate() / 1e12,
        if p.hardware.attention_flops_per_s.is_some() {
            ""
        } else {
            " (the products' rate: not measured)"
        },
        pp.ops_s
    );
}

/// Host memory by use.
fn write_dram(o: &mut String, p: &Plan) {
    let d = &p.dram;
    let _ = writeln!(
        o,
        "DRAM {} MiB{}: tables {}, fixed area {} layers, dynamic area {} buffers of {}, start-up staging {}",
        mib(d.total),
        p.budget
            .dram_mem
            .map_or(String::new(), |b| format!(" of {} MiB", mib(b))),
        mib(d.tables),
        d.fixed_layers,
        d.dynamic_buffers,
        mib(d.layer_bytes),
        mib(d.staging)
    );
}

/// What a decoded token moves, the hybrid or split share, and the predicted speed.
fn write_decode(o: &mut String, p: &Plan) {
    let t = &p.per_token;
    if p.prediction.step.sequences > 1 {
        let _ = writeln!(
            o,
            "per token of one sequence alone: host→device {} MiB, SSD {} MiB, device reads {} MiB",
            mib(t.h2d_bytes),
            mib(t.ssd_bytes),
            mib(t.hbm_read_bytes),
        );
    } else {
        write_token(o, p);
    }
    write_cpu_share(o, p);
    write_prediction(o, p);
}

/// What one token moves and takes (a sequence decoding alone).
fn write_token(o: &mut String, p: &Plan) {
    let t = &p.per_token;
    let pr = &p.prediction;
    let _ = writeln!(
        o,
        "per token: host→device {} MiB ({:.2} ms at {:.1} GB/s), SSD {} MiB ({:.2} ms at {:.1} GB/s), device reads {} MiB ({:.2} ms at {:.0} GB/s), {:.2} ms of op overhead",
        mib(t.h2d_bytes),
        pr.pcie_s * 1e3,
        p.hardware.h2d_pinned_bytes_per_s / 1e9,
        mib(t.ssd_bytes),
        pr.ssd_s * 1e3,
        p.hardware.ssd_read_bytes_per_s / 1e9,
        mib(t.hbm_read_bytes),
        pr.hbm_s * 1e3,
        p.hardware.hbm_bytes_per_s / 1e9,
        pr.ops_s * 1e3
    );
}

/// The hybrid or split share of the FFN.
fn write_cpu_share(o: &mut String, p: &Plan) {
    let pr = &p.prediction;
    if p.residency.ffn_off && p.budget.unit_reserve.is_some() {
        let _ = writeln!(
            o,
            "cache units: every FFN neuron off the device but in the units below; attention resident and streamed as above, beside them"
        );
    } else if p.residency.ffn_off {
        let _ = writeln!(
            o,
            "hybrid: every FFN neuron off the device but for the hot ones placed below; the CPU computes the others from DRAM"
        );
    } else if p.residency.cpu_rows > 0 {
        let _ = writeln!(
            o,
            "CPU+PCIe split: the last {} FFN neurons of every layer computed by the CPU from DRAM ({} MiB held), {} MiB read per {} ({:.2} ms with the round trips, at {:.1} GB/s), beside the copies of the rest, continuing the device's sum",
            p.residency.cpu_rows,
            mib(p.dram.cpu_rows),
            mib(pr.step.cpu_read_bytes),
            if pr.step.sequences > 1 {
                "step"
            } else {
                "token"
            },
            pr.cpu_s * 1e3,
            p.hardware.dram_read_bytes_per_s / 1e9,
        );
    }
}

/// The predicted decode speed: one sequence's, or the aggregate of a step of several.
fn write_prediction(o: &mut String, p: &Plan) {
    let pr = &p.prediction;
    let st = &pr.step;
    if st.sequences > 1 {
        let _ = writeln!(
            o,
            "per decode step of {} sequences (a token of each; weights read once, every row computed): host→device {} MiB ({:.2} ms), device reads {} MiB ({:.2} ms), device {:.2} GFLOP ({:.2} ms at {:.2} TFLOP/s), CPU {:.2} GFLOP, {:.2} ms in all (at {:.2} TFLOP/s)",
            st.sequences,
            mib(st.h2d_bytes),
            pr.pcie_s * 1e3,
            mib(st.hbm_read_bytes),
            pr.hbm_s * 1e3,
            st.device_flops / 1e9,
            st.compute_s * 1e3,
            p.hardware.matmul_flops_per_s / 1e12,
            st.cpu_flops / 1e9,
            pr.cpu_s * 1e3,
            crate::plan::batch::cpu_flops_per_s(&p.hardware) / 1e12
        );
        let _ = writeln!(
            o,
            "predicted decode: {:.2} tokens/s in all for {} sequences, {:.2} each (bound by {})",
            pr.tokens_per_s,
            st.sequences,
            pr.tokens_per_s / st.sequences as f64,
            pr.limited_by
        );
        return;
    }
    let _ = writeln!(
        o,
        "predicted decode: {:.2} tokens/s (bound by {})",
        pr.tokens_per_s, pr.limited_by
    );
}
