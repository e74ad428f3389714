//! `gpu-offload bench precision`: the search for mixed-precision neuron shares (M2Cache): for
//! each candidate (f16 / INT8 / INT4 percentages of each token's active neurons), the cache-unit
//! engine's perplexity on calibration text, against all-f16 at the same sparsity; what each
//! saves per token by the plan; saved in the store, where `--neuron-precision auto` picks the
//! fastest of those within the tolerance for the run's budget.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Args;
use serde::Serialize;

use crate::engine::perplexity::perplexity;
use crate::model::tokenizer::Tokenizer;
use crate::plan::choice::Cold;
use crate::plan::precision::{NeuronPrecision, Precision, PrecisionScore, PrecisionSearch};
use crate::runtime::ModelArgs;
use crate::runtime::corpus::read_corpus;
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
pub struct PrecisionRow {
    #[serde(flatten)]
    pub score: PrecisionScore,
    /// By the run's unit plan: host→device and device bytes per decoded token.
    pub pcie_bytes_per_token: u64,
    pub hbm_bytes_per_token: u64,
    pub predicted_tokens_per_s: f64,
    pub seconds: f64,
}

/// What `bench precision` measured: every candidate, the search as saved, and what it ran on.
pub struct PrecisionRun {
    /// The store the candidates ran from (and the search is saved in).
    pub store_dir: PathBuf,
    pub corpus: PathBuf,
    pub sparsity_target: f64,
    /// Tokens per perplexity chunk.
    pub ctx: usize,
    pub rows: Vec<PrecisionRow>,
    pub search: PrecisionSearch,
}

/// Score every candidate of `args` on its calibration text; save the search unless
/// `--no-save`. Sets `--cold gpu` and each candidate's `--neuron-precision` on `args.model`.
pub fn run(args: &mut PrecisionArgs) -> Result<PrecisionRun> {
    let candidates = candidates(args)?;
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
    let mut rows: Vec<PrecisionRow> = Vec::new();
    for &p in &candidates {
        args.model.budget.neuron_precision = NeuronPrecision::Fixed(p);
        let base = rows.first().map(|b| b.score.ppl);
        let row = score(args, &loaded, tok, &tokens, ctx, p, base)?;
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
    Ok(PrecisionRun {
        store_dir,
        corpus,
        sparsity_target: target,
        ctx,
        rows,
        search,
    })
}

/// All-f16 first, then `--candidates` (or the whole grid), each once; `--tolerance` checked.
fn candidates(args: &PrecisionArgs) -> Result<Vec<Precision>> {
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
    Ok(candidates)
}

/// One candidate: the cache-unit engine at precision `p`, its perplexity (against `base`, the
/// all-f16 perplexity, when there is one yet) and what the plan says it moves per token.
fn score(
    args: &PrecisionArgs,
    loaded: &LoadedModel,
    tok: &Tokenizer,
    tokens: &[u32],
    ctx: usize,
    p: Precision,
    base: Option<f64>,
) -> Result<PrecisionRow> {
    let running = loaded
        .start(&args.model, Job::single(ctx, ctx, ctx))
        .with_context(|| format!("cache units at {p}"))?;
    let Some(units) = &running.units else {
        bail!("cache units did not run: use --device sim (or cuda) with a bundled store");
    };
    let plan = units.plan.clone();
    let t0 = Instant::now();
    let r = with_engine!(&running.engine, e => {
        perplexity(e, tokens, ctx, tok.bos(), Some(args.chunks as usize), &mut |_, _| {})?
    });
    let base = base.unwrap_or(r.ppl);
    let neuron_bytes = (0..3)
        .map(|i| p.0[i] as f64 / 100.0 * plan.neuron_bytes[i] as f64)
        .sum();
    Ok(PrecisionRow {
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
    })
}
