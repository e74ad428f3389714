//! `gpu-offload bench`: measured speed beside its physical bound, in one run. Each benchmark is
//! `crate::bench`'s (one file or folder each, with its flags); this file dispatches the
//! subcommands and prints what they measured (tables, `--json`).
//! - `matvec`: one weight matrix times a few vectors; bytes/s against the memory it streams from.
//! - `attention`: a prompt's causal attention over its cache (the prefill kernel, or the decode
//!   kernel for a few rows); FLOP/s beside a matrix product's of the same rows, same run.
//! - `sparse`: the neuron-sparse FFN kernels (`backend::cpu::sparse`) on a 7B-shaped layer at
//!   several active fractions: bytes/s on the bundles they touch against the DRAM read rate, and
//!   the speed-up over the dense bundle kernels.
//! - `decode`: a model end to end (TTFT, prefill and decode tokens/s) against the bound of the
//!   resource it must move bytes through (device memory, PCIe, DRAM or SSD).
//! - `suite`: the consumer-GPU benchmark: a matrix of `--gpu-mem` budgets × prompt lengths,
//!   every figure beside its bound and the plan's prediction, peers in the same run, written as
//!   JSON, Markdown and SVG plots (`crate::bench::suite`).
//! - `contexts`: the LLMS trace benchmark (`crate::bench::contexts`): context-switch latency and
//!   TTFT of five ways to keep contexts, on one trace.
//! - `units`, `precision`: M2Cache's cache units and mixed-precision neurons
//!   (`crate::bench::units`, `crate::bench::precision`).
//!
//! Bounds are measured rates (or a `--hardware` profile's figures); a figure more than 5% above
//! its bound is an error: the bound is wrong.

use std::io::Write;

use anyhow::Result;
use clap::{Args, Subcommand};
use serde_json::json;

use crate::bench;
use crate::bench::decode::DecodeOutcome;
use crate::bench::precision::PrecisionRun;
use crate::plan::precision::{PrecisionSearch, TIER_ENCODINGS};

#[derive(Debug, Args)]
pub struct BenchArgs {
    #[command(subcommand)]
    pub what: BenchWhat,
}

#[derive(Debug, Subcommand)]
pub enum BenchWhat {
    /// Matrix × vector(s): achieved bandwidth against the device's.
    Matvec(bench::matvec::MatvecArgs),
    /// Causal attention of query rows over a KV cache (the prefill kernel for a prompt, the
    /// decode kernel for a few rows over a long context): FLOP/s beside a matrix product's of
    /// as many rows in the same run.
    Attention(bench::attention::AttentionArgs),
    /// Neuron-sparse FFN (PowerInfer-style) on the CPU: bandwidth on the bytes touched and
    /// speed-up over dense, at several active fractions.
    Sparse(bench::sparse::SparseArgs),
    /// A model end to end: TTFT, prefill and decode tokens/s against the bound.
    Decode(bench::decode::DecodeArgs),
    /// The consumer-GPU benchmark: --gpu-mem budgets × prompt lengths, bounds, predictions and
    /// peers; writes suite.json, suite.md and SVG plots.
    Suite(bench::suite::runner::SuiteArgs),
    /// HBM cache units (M2Cache): on a decode trace of held-out text, the share of each token's
    /// active neurons already in the unit under the adjacent-token update, against an LRU of the
    /// same size and against reloading the whole active set.
    Units(bench::units::UnitsArgs),
    /// Expert caches for mixture-of-experts models: on a decode trace (the model's routing, or
    /// one drawn with stated statistics), each layer's share of routed experts already on the
    /// device under the ATU, an LRU and a static set of the most frequent experts, at cache
    /// sizes of 1×, 2× and 4× the experts a token uses.
    Experts(bench::experts::ExpertsArgs),
    /// Mixed-precision neurons (M2Cache): the cache-unit engine's perplexity on calibration
    /// text at each candidate share of f16 / INT8 / INT4 neurons, against all-f16, and what
    /// each saves per token; saved in the store for --neuron-precision auto.
    Precision(bench::precision::PrecisionArgs),
    /// Persistent contexts (LLMS) on a trace: N contexts, Poisson calls, only --resident of them
    /// on the device; recompute, whole swap, chunked swap (exact, int8) and ours compared on
    /// context-switch latency, TTFT and the contexts served within a latency target; writes
    /// contexts.json, contexts.md and contexts.svg.
    Contexts(bench::contexts::runner::ContextsArgs),
}

pub fn run(a: BenchArgs) -> Result<()> {
    match a.what {
        BenchWhat::Matvec(m) => matvec(m),
        BenchWhat::Attention(a) => attention(a),
        BenchWhat::Sparse(s) => sparse(s),
        BenchWhat::Decode(d) => decode(d),
        BenchWhat::Suite(s) => suite(s),
        BenchWhat::Units(u) => units(u),
        BenchWhat::Experts(e) => experts(e),
        BenchWhat::Precision(p) => precision(p),
        BenchWhat::Contexts(c) => contexts(c),
    }
}

fn matvec(a: bench::matvec::MatvecArgs) -> Result<()> {
    let r = bench::matvec::run(&a)?;
    let dtype = a.dtype;
    let (secs, bytes, achieved, cuda) = (r.seconds, r.weight_bytes, r.achieved_bytes_per_s, r.cuda);
    let (bound_name, bound, source) = (r.bound_name, r.bound_bytes_per_s, &r.bound_from);
    if a.json {
        println!(
            "{}",
            json!({"rows": a.rows, "cols": a.cols, "dtype": dtype.name(), "tokens": a.tokens, "seconds": secs,
                   "weight_bytes": bytes, "achieved_bytes_per_s": achieved, "bound": bound_name,
                   "bound_bytes_per_s": bound, "fraction_of_bound": achieved / bound,
                   "bound_from": source, "device": if cuda { "cuda" } else { "cpu" }})
        );
    } else {
        println!(
            "matvec {}x{} {dtype} × {} vector(s) on {}: {:.1} µs, {:.1} GB/s = {:.0}% of {} {:.1} GB/s ({source})",
            a.rows,
            a.cols,
            a.tokens,
            if cuda { "cuda" } else { "cpu" },
            secs * 1e6,
            achieved / 1e9,
            100.0 * achieved / bound,
            bound_name,
            bound / 1e9
        );
    }
    r.check_bound()
}

fn attention(a: bench::attention::AttentionArgs) -> Result<()> {
    let r = bench::attention::run(&a)?;
    let (device, splits, secs, flops) = (r.device, r.flash_splits, r.seconds, r.flops);
    let (rate, matmul, qd, kv) = (
        r.flops_per_s,
        r.matmul_flops_per_s,
        r.query_width,
        &r.kv_type,
    );
    if a.json {
        println!(
            "{}",
            json!({"rows": a.rows, "context": a.context, "heads": a.heads, "kv_heads": a.kv_heads,
                   "head_dim": a.head_dim, "kv_type": kv, "device": device,
                   "flash_splits": splits, "seconds": secs,
                   "flops": flops, "flops_per_s": rate, "matmul_flops_per_s": matmul,
                   "fraction_of_matmul": rate / matmul})
        );
    } else {
        println!(
            "attention of {} rows from position {} ({} heads / {} KV heads of {}, {kv} cache{}) on {device}: {:.3} ms, {:.2} TFLOP/s = {:.0}% of a {}x{qd}x{qd} f16 matrix product's {:.2} TFLOP/s",
            a.rows,
            a.context,
            a.heads,
            a.kv_heads,
            a.head_dim,
            splits.map_or(String::new(), |s| format!(", keys split {s} ways")),
            secs * 1e3,
            rate / 1e12,
            100.0 * rate / matmul,
            a.rows,
            matmul / 1e12
        );
    }
    Ok(())
}

fn sparse(a: bench::sparse::SparseArgs) -> Result<()> {
    let mut timer = bench::sparse::SparseBench::new(&a)?;
    let (d, neurons, n) = (a.d, a.neurons, a.tokens);
    let (bound, source) = (timer.bound, timer.source.clone());
    let mut rows = Vec::new();
    if !a.json {
        println!(
            "sparse FFN {neurons} neurons × d {d}, gated, {n} token(s), {} threads, {} kernels; DRAM read bound {:.1} GB/s ({source})",
            timer.threads(),
            timer.kernels(),
            bound / 1e9
        );
        println!(
            "{:<6} {:>7} {:>10} {:>10} {:>8} {:>7} {:>12} {:>10} {:>8}",
            "enc", "active", "µs", "MB", "GB/s", "÷DRAM", "partials µs", "dense µs", "speed-up"
        );
    }
    for &enc in &a.encodings.0 {
        let timed = timer.encoding(enc)?;
        for r in timed.rows {
            if !a.json {
                let f = |k: &str| r[k].as_f64().unwrap_or(f64::NAN);
                println!(
                    "{:<6} {:>6}% {:>10.0} {:>10.1} {:>8.1} {:>7.2} {:>12.0} {:>10.0} {:>7.2}×",
                    enc.name(),
                    r["active_percent"],
                    f("seconds") * 1e6,
                    f("bytes") / 1e6,
                    f("bytes_per_s") / 1e9,
                    f("fraction_of_dram"),
                    f("seconds_partials_split") * 1e6,
                    f("dense_seconds") * 1e6,
                    f("speedup"),
                );
            }
            rows.push(r);
        }
        if !a.json && !timed.dense_kernel {
            println!(
                "{:<6} (no dense kernel for {}: dense = sparse at 100%)",
                "",
                enc.name()
            );
        }
    }
    if a.json {
        println!("{}", timer.json(rows));
    }
    Ok(())
}

fn decode(a: bench::decode::DecodeArgs) -> Result<()> {
    match bench::decode::run(&a)? {
        DecodeOutcome::Single(r) => decode_single(&a, &r),
        DecodeOutcome::Sessions(r) => decode_sessions(&a, &r),
        DecodeOutcome::Batches(r) => decode_batches(&a, &r),
    }
}

fn decode_single(a: &bench::decode::DecodeArgs, r: &bench::decode::DecodeRun) -> Result<()> {
    let (spec_name, device, m, out) = (&r.model, r.device, &r.measured, &r.json);
    let (prefill_step, bound, rates, predicted) = (r.prefill_step, &r.bound, &r.rates, r.predicted);
    let (recorded, replayed) = (r.recorded, r.replayed);
    if a.json {
        println!("{out}");
    } else {
        println!(
            "{} on {device}: TTFT {:.1} ms ({} prompt tokens in steps of {}, {:.0} tok/s), decode {:.2} tok/s = {:.0}% of the {} bound {:.2} tok/s ({}){}",
            spec_name,
            m.ttft_s * 1e3,
            a.prompt_tokens,
            prefill_step.min(a.prompt_tokens),
            m.prefill_tokens_per_s,
            m.decode_tokens_per_s,
            100.0 * m.decode_tokens_per_s / bound.tokens_per_s,
            bound.limited_by,
            bound.tokens_per_s,
            rates.source,
            predicted.map_or(String::new(), |p| format!(
                "; the plan predicted {p:.2} tok/s"
            ))
        );
        if r.cuda_graphs {
            println!("decode steps recorded {recorded}, replayed {replayed}");
        }
        if let Some(k) = m.device_ops_per_decode_step {
            println!("{k:.1} device operations (kernels, on-device copies) per decode step");
        }
        print_experts(&out["experts"]);
        print_predictors(&out["predictors"]);
        if let Some(path) = &a.trace {
            print_phases(&out["phases_per_token"]);
            println!("trace of the last repetition written to {}", path.display());
        }
    }
    r.check_bound()?;
    Ok(())
}

/// The predictors of a `--sparsity predicted` run: their held-out recall and share (as the
/// plan costs them) and, with `--recall`, the same on the run's own tokens.
fn print_predictors(p: &serde_json::Value) {
    let f = |v: &serde_json::Value, k: &str| v[k].as_f64();
    if let (Some(r), Some(s)) = (f(p, "recall_held_out"), f(p, "predicted_share_held_out")) {
        println!(
            "predictors: recall {r:.3}, {:.1}% of the neurons named, on the profile's held-out tokens",
            100.0 * s
        );
    }
    let m = &p["measured"];
    if let (Some(r), Some(named), Some(active)) =
        (f(m, "recall"), f(m, "named_share"), f(m, "active_share"))
    {
        println!(
            "predictors on this run's {} tokens: recall {r:.3}, {:.1}% of the neurons named, {:.1}% active",
            m["tokens"],
            100.0 * named,
            100.0 * active
        );
    }
}

/// A mixture-of-experts run's experts over the bench (prompts and decode): where they ran, the
/// units' hits beside the plan's expectation, the next-layer guesses, the SSD tier's reads.
fn print_experts(x: &serde_json::Value) {
    let Some(t) = x.get("totals") else {
        return;
    };
    let n = |k: &str| t[k].as_u64().unwrap_or(0);
    let pct = |v: &serde_json::Value| {
        v.as_f64()
            .map_or("-".into(), |f| format!("{:.1}%", 100.0 * f))
    };
    println!(
        "experts ({}): {} needed (distinct a layer a step, summed), {} on the device (hit ratio {}, expected {}), {} on the CPU, {} streamed, {} from low-bit copies; {} copied in ({} by next-layer prefetch, guesses right {}); {} read from the store",
        x["mode"].as_str().unwrap_or("?"),
        n("needed"),
        n("hits"),
        pct(&x["hit_ratio"]),
        pct(&x["expected_hit_ratio"]),
        n("cpu_experts"),
        n("streamed"),
        n("low_bit_experts"),
        n("copies"),
        n("prefetched"),
        pct(&x["guess_precision"]),
        n("ssd_experts")
    );
}

/// Per decoded token, each phase's time, its share of the step and its bound.
fn print_phases(p: &serde_json::Value) {
    let step = p["step_seconds"].as_f64().unwrap_or(f64::NAN);
    println!("per decoded token ({:.3} ms a step):", step * 1e3);
    for (name, v) in p["phases"].as_object().into_iter().flatten() {
        let s = v["seconds"].as_f64().unwrap_or(f64::NAN);
        let bound = match (v["bound_seconds"].as_f64(), v["bound_by"].as_str()) {
            (Some(b), Some(by)) => format!(", bound {:.3} ms ({by})", b * 1e3),
            _ => String::new(),
        };
        println!(
            "  {name:<15}{:9.3} ms {:5.1}%{bound}",
            s * 1e3,
            100.0 * s / step
        );
    }
}

/// `bench decode --sessions N`: N sequences decoded together (one batched step per token of
/// each) against one alone, in one run on one engine: aggregate decode tokens/s of each.
fn decode_sessions(a: &bench::decode::DecodeArgs, r: &bench::decode::SessionsRun) -> Result<()> {
    let (spec_name, device, n, out) = (&r.model, r.device, r.sessions, &r.json);
    let (one, many) = (r.single_tokens_per_s, r.aggregate_tokens_per_s);
    if a.json {
        println!("{out}");
    } else {
        println!(
            "{} on {}: {n} sequences together {:.1} tok/s in all, one alone {:.1} tok/s ({:.2}×){}",
            spec_name,
            device,
            many,
            one,
            many / one,
            r.predicted_tokens_per_s.map_or(String::new(), |p| format!(
                "; the plan for {n} predicted {p:.1} tok/s in all"
            ))
        );
    }
    Ok(())
}

/// `bench decode --sessions 1,4,16 [--modes …]`: a row per mode and count, the measured
/// aggregate beside the plan's prediction; a mode that could not run says why.
fn decode_batches(a: &bench::decode::DecodeArgs, r: &bench::decode::BatchesRun) -> Result<()> {
    if a.json {
        println!("{}", r.json);
        return Ok(());
    }
    println!(
        "{} on {}: aggregate decode tokens/s of N sequences decoded together ({} tokens each after a {}-token prompt, median of {}), each under the plan for N",
        r.model, r.device, a.tokens, a.prompt_tokens, a.reps
    );
    println!(
        "{:<7} {:>8} {:<7} {:>10} {:>10} {:>9} {:>9}",
        "--cold", "sessions", "runs", "predicted", "measured", "÷predict", "÷1 alone"
    );
    for row in &r.rows {
        let mode = format!("{:?}", row.mode).to_lowercase();
        match &row.measured {
            Ok(m) => {
                let alone = r
                    .rows
                    .iter()
                    .find(|o| o.mode == row.mode && o.sessions == 1)
                    .and_then(|o| o.measured.as_ref().ok());
                let cell = |v: Option<f64>, f: &dyn Fn(f64) -> String| v.map_or("-".into(), f);
                println!(
                    "{:<7} {:>8} {:<7} {:>10} {:>10.1} {:>9} {:>9}",
                    mode,
                    row.sessions,
                    row.runs.unwrap_or("whole"),
                    cell(row.predicted_tokens_per_s, &|p| format!("{p:.1}")),
                    m,
                    cell(row.predicted_tokens_per_s, &|p| format!("{:.2}", m / p)),
                    cell(alone.copied(), &|o| format!("{:.2}×", m / o)),
                );
            }
            Err(e) => println!("{mode:<7} {:>8} could not run: {e}", row.sessions),
        }
    }
    Ok(())
}

fn suite(a: bench::suite::runner::SuiteArgs) -> Result<()> {
    let run = bench::suite::runner::run(a)?;
    let (report, dir) = (&run.report, &run.out);
    println!(
        "wrote {0}/suite.json, {0}/suite.md and {1} plot(s): {2} decode and {3} prefill cell(s), {4} problem(s)",
        dir.display(),
        run.plots,
        report.decode.len(),
        report.prefill.len(),
        report.problems.len()
    );
    run.check_problems()
}

fn contexts(a: bench::contexts::runner::ContextsArgs) -> Result<()> {
    let run = bench::contexts::runner::run(&a)?;
    let (json, md, plot) = (&run.json, &run.markdown, run.plot);
    if a.json {
        println!("{json}");
    } else {
        print!("{md}");
        println!(
            "wrote {0}/contexts.json, {0}/contexts.md{1}",
            a.out.display(),
            if plot.is_some() {
                " and contexts.svg"
            } else {
                ""
            }
        );
    }
    Ok(())
}

fn experts(a: bench::experts::ExpertsArgs) -> Result<()> {
    use bench::experts::TraceSource;
    let r = bench::experts::run(&a)?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&r)?);
        return Ok(());
    }
    match &r.source {
        TraceSource::Decoded {
            model,
            corpus,
            calibration,
        } => println!(
            "{model}: routing of {} tokens of {corpus} decoded one by one, experts ranked on {} tokens of {calibration}",
            r.tokens, r.calibration_tokens
        ),
        TraceSource::Synthetic { shape, statistics } => println!(
            "SYNTHETIC routing trace (not a model's): {shape} shape, popularity {}, locality {}, seed {}; {} tokens evaluated after {} ranking the experts",
            statistics.popularity,
            statistics.locality,
            statistics.seed,
            r.tokens,
            r.calibration_tokens
        ),
    }
    println!(
        "{} layers of {} experts, {} a token; at most {} copies a layer per token",
        r.layers, r.experts, r.used, r.max_copies
    );
    if let Some(p) = r.guess_precision {
        println!(
            "next-layer guess (the next router on this layer's FFN input): {:.1}% of guessed experts routed",
            100.0 * p
        );
    }
    let pct = |a: Option<crate::tier::atu::Admission>| {
        a.map_or_else(|| "-".into(), |a| format!("{:.1}%", 100.0 * a.hit_ratio()))
    };
    let per_token = |c: u64| c as f64 / r.tokens as f64;
    for s in &r.sizes {
        println!(
            "\n{:.2}× the experts a token uses ({} slots a layer): hit ratio ATU {:.1}%, LRU {:.1}%, static top {:.1}%; copies per token ATU {:.1}, LRU {:.1}",
            s.factor,
            s.layers.first().map_or(0, |l| l.slots),
            100.0 * s.atu.hit_ratio(),
            100.0 * s.lru.hit_ratio(),
            100.0 * s.static_top.hit_ratio(),
            per_token(s.atu.copies),
            per_token(s.lru.copies),
        );
        if let Some(p) = s.atu_prefetch {
            println!(
                "  ATU with next-layer prefetch: hit ratio {:.1}%, copies per token {:.1}",
                100.0 * p.hit_ratio(),
                per_token(p.copies)
            );
        }
        println!(
            "layer  adjacent overlap  experts for 90%  ATU hits  LRU hits  static hits  guess right  ATU+prefetch"
        );
        for l in &s.layers {
            println!(
                "{:>5}  {:>15.1}%  {:>15}  {:>7.1}%  {:>7.1}%  {:>10.1}%  {:>11}  {:>12}",
                l.layer,
                100.0 * l.adjacent_overlap,
                l.experts_for_90pct,
                100.0 * l.atu.hit_ratio(),
                100.0 * l.lru.hit_ratio(),
                100.0 * l.static_top.hit_ratio(),
                l.guess_precision
                    .map_or_else(|| "-".into(), |g| format!("{:.1}%", 100.0 * g)),
                pct(l.atu_prefetch)
            );
        }
    }
    Ok(())
}

fn units(a: bench::units::UnitsArgs) -> Result<()> {
    let report = bench::units::run(&a)?;
    let (args, d_ff, want) = (&a, report.d_ff, report.tokens);
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    println!(
        "{}: {} tokens of {} decoded one by one, FFN mask at {:.0}% sparsity ({} neurons per layer)",
        report.model,
        report.tokens,
        report.corpus,
        100.0 * report.sparsity_target,
        d_ff
    );
    for s in &report.sizes {
        println!(
            "\nunits of {:.2}× the layer's largest active set: ATU hit ratio {:.1}%, LRU {:.1}%; neurons loaded per token: ATU {:.0}, LRU {:.0}, reloading the active set {:.0}",
            s.factor,
            100.0 * s.atu.hit_ratio(),
            100.0 * s.lru.hit_ratio(),
            s.atu.loads() as f64 / want as f64,
            s.lru.loads() as f64 / want as f64,
            s.reload_loads as f64 / want as f64
        );
        println!("layer  slots  mean active  adjacent overlap  ATU hits  LRU hits");
        for l in &s.layers {
            println!(
                "{:>5}  {:>5}  {:>11.0}  {:>15.1}%  {:>7.1}%  {:>7.1}%",
                l.layer,
                l.slots,
                l.mean_active,
                100.0 * l.adjacent_overlap,
                100.0 * l.atu.hit_ratio(),
                100.0 * l.lru.hit_ratio()
            );
        }
    }
    Ok(())
}

fn precision(mut a: bench::precision::PrecisionArgs) -> Result<()> {
    let PrecisionRun {
        store_dir,
        corpus,
        sparsity_target: target,
        ctx,
        rows,
        search,
    } = bench::precision::run(&mut a)?;
    let args = &a;
    let mut out = std::io::stdout().lock();
    if args.json {
        let v = serde_json::json!({
            "model": store_dir.display().to_string(),
            "corpus": corpus.display().to_string(),
            "sparsity": search.sparsity,
            "sparsity_target": target,
            "tolerance": args.tolerance,
            "good": search.good().iter().map(|p| p.to_string()).collect::<Vec<_>>(),
            "candidates": rows,
        });
        writeln!(out, "{v}")?;
        return Ok(());
    }
    writeln!(
        out,
        "{}: {} sparsity at {:.0}%, perplexity on {} chunks of {} tokens of {}",
        store_dir.display(),
        search.sparsity,
        target * 100.0,
        args.chunks,
        ctx,
        corpus.display()
    )?;
    writeln!(
        out,
        "precision   perplexity      vs f16  bytes/neuron  PCIe/token  device/token  predicted tok/s"
    )?;
    for r in &rows {
        let s = &r.score;
        writeln!(
            out,
            "{:>9}  {:>8.4} ±{:.3}  {:>+6.2}%  {:>12.0}  {:>10}  {:>12}  {:>15.1}",
            s.precision.to_string(),
            s.ppl,
            s.ppl_std_err,
            (s.ratio - 1.0) * 100.0,
            s.neuron_bytes,
            crate::plan::human_bytes(r.pcie_bytes_per_token),
            crate::plan::human_bytes(r.hbm_bytes_per_token),
            r.predicted_tokens_per_s
        )?;
    }
    let good: Vec<String> = search.good().iter().map(|p| p.to_string()).collect();
    writeln!(
        out,
        "within {:.1}% of f16: {} (encodings {}){}",
        args.tolerance * 100.0,
        if good.is_empty() {
            "none".to_string()
        } else {
            good.join(", ")
        },
        TIER_ENCODINGS.map(|e| e.name()).join("/"),
        if args.no_save {
            String::new()
        } else {
            format!(
                "; saved to {}",
                PrecisionSearch::path_in(&store_dir).display()
            )
        }
    )?;
    Ok(())
}
