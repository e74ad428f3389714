//! `gpu-offload profile`: a model's FFN activation sparsity on a calibration corpus, saved in its
//! store (see `crate::sparsity`); for a mixture-of-experts model, its routing
//! ([`crate::sparsity::routing::RoutingProfile`]).

use std::path::{Path, PathBuf};

use anyhow::{Result, bail};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};

use crate::runtime::corpus::{corpus_tokens, read_corpus};
use crate::runtime::profiling::{ProfileRun, ProfileSettings, SparsityProfiler, hot_shares};
use crate::runtime::store::open_store_for;
use crate::sparsity::{GRID_TARGETS, SparsityProfile};
use crate::store::Store;

#[derive(Debug, Args)]
pub struct ProfileArgs {
    /// GGUF file or Hugging Face model directory [default: the model scripts/fetch-models.sh
    /// downloads]
    #[arg(long, short = 'm', env = "GPU_OFFLOAD_MODEL")]
    pub model: Option<PathBuf>,

    /// Calibration text (UTF-8) [default: the first 100 chapters of Moby-Dick, which
    /// scripts/fetch-models.sh fetches as moby-dick-profile.txt; the rest of the book,
    /// moby-dick-eval.txt, is held out for evaluation]
    #[arg(long, env = "GPU_OFFLOAD_CORPUS")]
    pub corpus: Option<PathBuf>,

    /// Calibrate on seeded random token ids instead of a corpus: for synthesized models, which
    /// have no tokenizer (their hot neurons are planted in the weights, not learned from text)
    #[arg(long, env = "GPU_OFFLOAD_RANDOM_CORPUS", conflicts_with = "corpus")]
    pub random_corpus: bool,

    /// Tokens of the corpus to profile on.
    #[arg(long, env = "GPU_OFFLOAD_PROFILE_TOKENS", default_value_t = 8192, value_parser = clap::value_parser!(u32).range(16..))]
    pub tokens: u32,

    /// Tokens per window (each window is a fresh context, as in perplexity).
    #[arg(long, env = "GPU_OFFLOAD_PROFILE_WINDOW", default_value_t = 512, value_parser = clap::value_parser!(u32).range(16..))]
    pub window: u32,

    /// Worker threads [default: one per core]
    #[arg(long, short = 't', env = "GPU_OFFLOAD_THREADS", value_parser = clap::value_parser!(u16).range(1..=1024))]
    pub threads: Option<u16>,

    /// Skip training the activation predictors (`--sparsity predicted` needs them).
    #[arg(long, env = "GPU_OFFLOAD_NO_PREDICTORS")]
    pub no_predictors: bool,

    /// Sparsity the predictors are trained for [default: 0.15, what --sparsity-target
    /// defaults to]
    #[arg(long, env = "GPU_OFFLOAD_PREDICTOR_TARGET", default_value_t = crate::runtime::DEFAULT_SPARSITY_TARGET,
          value_parser = crate::runtime::parse_share)]
    pub predictor_target: f64,

    /// Rank of each predictor's hidden layer.
    #[arg(long, env = "GPU_OFFLOAD_PREDICTOR_RANK", default_value_t = 128, value_parser = clap::value_parser!(u32).range(1..))]
    pub predictor_rank: u32,

    /// Tokens of pass 2 the predictors train on (a tenth held out for their cutoff).
    #[arg(long, env = "GPU_OFFLOAD_PREDICTOR_TOKENS", default_value_t = 4096, value_parser = clap::value_parser!(u32).range(20..))]
    pub predictor_tokens: u32,

    /// Print the summary as JSON.
    #[arg(long, env = "GPU_OFFLOAD_JSON")]
    pub json: bool,
}

pub fn run(args: ProfileArgs) -> Result<()> {
    let model_path = args
        .model
        .clone()
        .unwrap_or_else(crate::model::default_model_path);
    if !model_path.exists() {
        bail!(
            "{} does not exist: pass --model (or run scripts/fetch-models.sh for the default)",
            model_path.display()
        );
    }
    let want = args.tokens as usize;
    // The corpus is checked before the model loads: a bad one fails at once.
    let text = if args.random_corpus {
        None
    } else {
        Some(read_corpus(
            args.corpus.as_deref(),
            "moby-dick-profile.txt",
        )?)
    };
    let corpus_name = match &text {
        Some((corpus, _)) => corpus.display().to_string(),
        None => "random token ids (seed 7)".to_string(),
    };
    let store = open_store_for(&model_path)?;
    let model = crate::runtime::store::model_for(&model_path, &store)?;
    let all = match (&text, &model.tokenizer) {
        (Some((corpus, text)), Some(tokenizer)) => corpus_tokens(corpus, text, tokenizer, want)?,
        (Some(_), None) => bail!(
            "{} has no tokenizer: profiling needs one to read the corpus (a synthesized model: pass --random-corpus)",
            model_path.display()
        ),
        (None, _) => {
            use rand::{RngExt, SeedableRng};
            let mut rng = rand::rngs::StdRng::seed_from_u64(7);
            let hi = (model.spec.vocab_size as u32).max(4);
            (0..want).map(|_| rng.random_range(3..hi)).collect()
        }
    };
    let window = (args.window as usize).min(model.spec.max_context);
    let tokens = &all[..want];
    let settings = ProfileSettings {
        threads: args.threads.map_or(0, usize::from),
        predictors: !args.no_predictors,
        predictor_target: args.predictor_target,
        predictor_tokens: args.predictor_tokens as usize,
        predictor_rank: args.predictor_rank as usize,
    };
    if let Some(moe) = model.spec.moe.clone() {
        return profile_experts(
            &args,
            (&model_path, &store),
            model,
            (tokens, window, &corpus_name),
            moe.experts,
        );
    }
    let profiler = SparsityProfiler::new(&model.spec, model.weights, settings)?;
    let pb = ProgressBar::new(0);
    pb.set_style(
        ProgressStyle::with_template("{elapsed_precise} [{bar:40}] {pos}/{len} windows ({msg})")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let passes = profiler.passes(tokens, window, &mut |done, total| {
        pb.set_length(total as u64);
        pb.set_position(done as u64);
        pb.set_message(if done * 2 <= total {
            "pass 1: thresholds"
        } else {
            "pass 2: frequencies"
        });
    })?;
    pb.finish_and_clear();
    let run = profiler.finish(passes, &store, corpus_name.clone())?;
    print_summary(&args, &model_path, &store, &corpus_name, &run);
    Ok(())
}

/// A mixture-of-experts model: its routing profile (per layer, how many tokens each expert
/// took), saved in the store; the summary says how concentrated each layer's routing is.
fn profile_experts(
    args: &ProfileArgs,
    (model_path, store): (&Path, &Store),
    model: crate::model::Model,
    (tokens, window, corpus): (&[u32], usize, &str),
    experts: usize,
) -> Result<()> {
    let t0 = std::time::Instant::now();
    let pb = ProgressBar::new(0);
    let p = crate::runtime::profiling::profile_routing(
        &model.spec,
        model.weights,
        store,
        (tokens, window, corpus),
        args.threads.map_or(0, usize::from),
        &mut |done, total| {
            pb.set_length(total as u64);
            pb.set_position(done as u64);
        },
    )?;
    pb.finish_and_clear();
    // Per layer: experts holding 90% of the routings, and the top `used`'s share.
    let used = model.spec.moe.as_ref().map_or(1, |m| m.used);
    let layers: Vec<(usize, f64)> = (0..p.counts.len())
        .map(|l| {
            let (_, shares) = p.ranked(l);
            let mut acc = 0.0;
            let for_90 = shares
                .iter()
                .position(|s| {
                    acc += s;
                    acc >= 0.9 - 1e-9
                })
                .map_or(experts, |i| i + 1);
            (for_90, shares.iter().take(used).sum())
        })
        .collect();
    let path = crate::sparsity::routing::RoutingProfile::path_in(store.dir());
    if args.json {
        let v = serde_json::json!({
            "store": store.dir(), "model_id": p.model_id, "corpus": p.corpus,
            "tokens": p.tokens, "experts": experts, "seconds": t0.elapsed().as_secs_f64(),
            "experts_for_90pct_of_routings": layers.iter().map(|l| l.0).collect::<Vec<_>>(),
            "top_k_share": layers.iter().map(|l| l.1).collect::<Vec<_>>(),
            "profile": path,
        });
        println!("{v}");
    } else {
        println!(
            "routing of {} on {} tokens of {corpus} in {:.1} s → {}",
            model_path.display(),
            p.tokens,
            t0.elapsed().as_secs_f64(),
            path.display()
        );
        println!("layer  experts for 90% of routings (of {experts})  top-{used} share");
        for (l, (n, top)) in layers.iter().enumerate() {
            println!("{l:>5}  {n:>36}  {:>10.1}%", 100.0 * top);
        }
    }
    Ok(())
}

/// The summary: as JSON, or a table per layer (and the predictors' quality where trained).
fn print_summary(
    args: &ProfileArgs,
    model_path: &Path,
    store: &Store,
    corpus_name: &str,
    run: &ProfileRun,
) {
    let profile = &run.profile;
    let window = profile.window;
    let (secs, params, model_params, train_s) = (
        run.seconds,
        run.predictor_parameters,
        run.model_parameters,
        run.train_seconds,
    );
    // How skewed the layers are: the share of neurons holding 80% of the activations at 50%.
    // 50%: grid target 9 (5% steps), fine target 49 (1% steps).
    let (k50, f50) = (GRID_TARGETS / 2, 49);
    let skew = hot_shares(profile, k50);
    if args.json {
        let v = serde_json::json!({
            "store": store.dir(),
            "model_id": profile.model_id,
            "corpus": profile.corpus,
            "tokens": profile.tokens,
            "window": window,
            "seconds": secs,
            "thresholds_at_50pct": profile.thresholds.iter().map(|t| t[f50]).collect::<Vec<_>>(),
            "measured_sparsity_at_50pct": profile.measured.iter().map(|m| m[k50]).collect::<Vec<_>>(),
            "hot_share_for_80pct_of_activations": skew,
            "predictor_target": profile.predictor_target,
            "predictors": profile.predictor_quality,
            "predictor_parameters": params,
            "predictor_share_of_model": params as f64 / model_params as f64,
            "predictor_training_seconds": train_s,
        });
        println!("{v}");
    } else {
        println!(
            "profiled {} on {} tokens of {} in {:.1} s → {}",
            model_path.display(),
            profile.tokens,
            corpus_name,
            secs,
            SparsityProfile::path_in(store.dir()).display()
        );
        println!("layer  threshold@50%  measured@50%  neurons holding 80% of activations");
        for (l, hot) in skew.iter().enumerate() {
            println!(
                "{l:>5}  {:>13.5}  {:>11.1}%  {:>6.1}%",
                profile.thresholds[l][f50],
                100.0 * profile.measured[l][k50],
                100.0 * hot
            );
        }
        if let Some(t) = profile.predictor_target {
            println!(
                "predictors for {:.0}% sparsity: {} parameters ({:.1}% of the model), trained in {train_s:.1} s",
                t * 100.0,
                params,
                100.0 * params as f64 / model_params as f64
            );
            println!("layer  recall  precision  predicted  active  epochs");
            for (l, q) in profile.predictor_quality.iter().enumerate() {
                println!(
                    "{l:>5}  {:>6.3}  {:>9.3}  {:>8.1}%  {:>5.1}%  {:>6}",
                    q.recall,
                    q.precision,
                    100.0 * q.predicted_share,
                    100.0 * q.active_share,
                    q.epochs
                );
            }
        }
    }
}
