//! `gpu-offload bench precision`: the search for mixed-precision neuron shares (M2Cache): for
//! each candidate (f16 / INT8 / INT4 percentages of each token's active neurons), the cache-unit
//! engine's perplexity on calibration text, against all-f16 at the same sparsity; what each
//! saves per token by the plan; saved in the store, where `--neuron-precision auto` picks the
//! fastest of those within the tolerance for the run's budget.

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Args;
use serde::Serialize;

use super::profile::read_corpus;
use crate::engine::perplexity::perplexity;
use crate::plan::choice::Cold;
use crate::plan::precision::{
    NeuronPrecision, Precision, PrecisionScore, PrecisionSearch, TIER_ENCODINGS,
};
use crate::runtime::ModelArgs;
use crate::runtime::{DEFAULT_SPARSITY_TARGET, Job, LoadedModel, with_engine};
use crate::store::Store;

#[derive(Debug, Args)]
pub struct PrecisionArgs {
    #[command(flatten)]
    pub model: ModelArgs,

    /// Calibration text [default: moby-dick-profile.txt, the text the profile was made on]
    #[arg(long, env = "GPU_OFFLOAD_CORPUS")]
    pub corpus: Option<PathBuf>,

    /// Tokens per perplexity chunk.
    #[arg(long, env = "GPU_OFFLOAD_CTX", default_value_t = 256, value_parser = clap::value_parser!(u32).range(8..))]
    pub ctx: u32,

    /// Chunks scored per candidate. Fewer cannot tell shares 1% apart: on SmolLM2, 4 chunks
    /// (508 tokens) and 12 ranked 25/0/75 and 25/25/50 the other way round.
    #[arg(long, env = "GPU_OFFLOAD_CHUNKS", default_value_t = 12, value_parser = clap::value_parser!(u32).range(1..))]
    pub chunks: u32,

    /// Candidates, comma-separated (fp16 or A/B/C) [default: every split in steps of 25%]
    #[arg(long, env = "GPU_OFFLOAD_CANDIDATES", value_delimiter = ',')]
    pub candidates: Vec<String>,

    /// Largest perplexity increase over all-f16 a candidate may have to be used, as a fraction.
    #[arg(long, env = "GPU_OFFLOAD_TOLERANCE", default_value_t = 0.01)]
    pub tolerance: f64,

    /// Do not save the result in the store.
    #[arg(long, env = "GPU_OFFLOAD_NO_SAVE")]
    pub no_save: bool,

    /// Print the result as JSON.
    #[arg(long, env = "GPU_OFFLOAD_JSON")]
    pub json: bool,
}

/// One candidate as measured and planned.
#[derive(Debug, Serialize)]
struct Row {
    #[serde(flatten)]
    score: PrecisionScore,
    /// By the run's unit plan: host→device and device bytes per decoded token.
    pcie_bytes_per_token: u64,
    hbm_bytes_per_token: u64,
    predicted_tokens_per_s: f64,
    seconds: f64,
}

pub fn run(mut args: PrecisionArgs) -> Result<()> {
    if !(args.tolerance.is_finite() && args.tolerance >= 0.0) {
        bail!("--tolerance {} is not a fraction ≥ 0", args.tolerance);
    }
    let mut candidates = vec![Precision::FP16];
    let asked: Vec<Precision> = if args.candidates.is_empty() {
        Precision::search_grid()
    } else {
        args.candidates
            .iter()
            .map(|c| c.parse().map_err(anyhow::Error::msg))
            .collect::<Result<_>>()
            .context("--candidates")?
    };
    for p in asked {
        if !candidates.contains(&p) {
            candidates.push(p);
        }
    }
    let (corpus, text) = read_corpus(args.corpus.as_deref(), "moby-dick-profile.txt")?;
    let loaded = LoadedModel::load(&args.model)?;
    let tok = loaded.tokenizer()?;
    let ctx = args.ctx as usize;
    if ctx > loaded.spec().max_context {
        bail!(
            "--ctx {ctx} exceeds the model's maximum context of {} tokens",
            loaded.spec().max_context
        );
    }
    let tokens = tok.encode(&text, false, false)?;
    if tokens.len() < ctx {
        bail!(
            "{} has {} tokens; scoring needs at least one chunk of --ctx {ctx}",
            corpus.display(),
            tokens.len()
        );
    }
    let store_dir = loaded.path.clone();
    let store = Store::open(&store_dir).with_context(|| {
        format!(
            "bench precision runs cache units from a store: pass the store directory ({} is not one)",
            store_dir.display()
        )
    })?;
    let target = args
        .model
        .sparsity_target
        .unwrap_or(DEFAULT_SPARSITY_TARGET);
    args.model.budget.cold = Cold::Gpu;
    let mut rows: Vec<Row> = Vec::new();
    for &p in &candidates {
        args.model.budget.neuron_precision = NeuronPrecision::Fixed(p);
        let running = loaded
            .start(&args.model, Job::single(ctx, ctx, ctx))
            .with_context(|| format!("cache units at {p}"))?;
        let Some(units) = &running.units else {
            bail!("cache units did not run: use --device sim (or cuda) with a bundled store");
        };
        let plan = units.plan.clone();
        let t0 = Instant::now();
        let r = with_engine!(&running.engine, e => {
            perplexity(e, &tokens, ctx, tok.bos(), Some(args.chunks as usize), &mut |_, _| {})?
        });
        let base = rows.first().map_or(r.ppl, |b| b.score.ppl);
        let neuron_bytes = (0..3)
            .map(|i| p.0[i] as f64 / 100.0 * plan.neuron_bytes[i] as f64)
            .sum();
        let row = Row {
            score: PrecisionScore {
                precision: p,
                ppl: r.ppl,
                ppl_std_err: r.ppl_std_err,
                ratio: r.ppl / base,
                neuron_bytes,
            },
            pcie_bytes_per_token: plan.per_token.pcie_bytes,
            hbm_bytes_per_token: plan.per_token.hbm_bytes,
            predicted_tokens_per_s: plan.predicted_tokens_per_s,
            seconds: t0.elapsed().as_secs_f64(),
        };
        if !args.json {
            eprintln!(
                "{:>9}  perplexity {:.4} ({:+.2}%)",
                p.to_string(),
                row.score.ppl,
                (row.score.ratio - 1.0) * 100.0
            );
        }
        rows.push(row);
    }
    let search = PrecisionSearch {
        model_id: store.manifest.model_id.clone(),
        sparsity: format!("{:?}", args.model.sparsity).to_lowercase(),
        target,
        tolerance: args.tolerance,
        tokens_scored: (ctx - ctx / 2 - 1) * args.chunks as usize,
        scores: rows.iter().map(|r| r.score.clone()).collect(),
    };
    if !args.no_save {
        search.save(&store_dir)?;
    }
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
