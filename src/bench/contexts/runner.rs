//! `bench contexts` end to end: the flags (defined here), the model loaded, the conversations'
//! tokens (a corpus, or seeded random ids), the main trace and the sweep's, the engine started
//! with `--resident` slots, every strategy replayed, and the report written (contexts.json,
//! contexts.md, contexts.svg). What it prints is the CLI's.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::Args;

use super::replay;
use super::report::{
    ContextsReport, CostInfo, DeviceInfo, ModelInfo, SCHEMA, Settings, most_contexts, notes,
    speedups,
};
use super::strategies::{RunSettings, Strategy};
use super::trace::{TokenSource, Trace, TraceConfig};
use crate::bench::output::{unix_now, writable_dir};
use crate::bench::plot;
use crate::bench::running::{device_of, threads_of};
use crate::runtime::corpus::read_corpus;
use crate::runtime::parse_bytes;
use crate::runtime::{Job, LoadedModel, ModelArgs, with_engine};

/// `MIN-MAX` or `N` (inclusive).
fn parse_token_range(s: &str) -> std::result::Result<(usize, usize), String> {
    let bad = || format!("`{s}` is not a token count N or a range MIN-MAX (e.g. 30-200)");
    let (a, b) = match s.split_once('-') {
        Some((a, b)) => (a, b),
        None => (s, s),
    };
    let a: usize = a.trim().parse().map_err(|_| bad())?;
    let b: usize = b.trim().parse().map_err(|_| bad())?;
    if a == 0 || a > b {
        return Err(bad());
    }
    Ok((a, b))
}

/// `2,4,8`: context counts for the sweep.
#[derive(Clone, Debug)]
pub struct CountList(pub Vec<usize>);

fn parse_counts(s: &str) -> std::result::Result<CountList, String> {
    if s.trim().is_empty() || s.trim() == "none" {
        return Ok(CountList(Vec::new()));
    }
    s.split(',')
        .map(|p| match p.trim().parse::<usize>() {
            Ok(v) if v >= 1 => Ok(v),
            _ => Err(format!("`{p}` is not a number of contexts (1 or more)")),
        })
        .collect::<std::result::Result<_, _>>()
        .map(CountList)
}

/// `recompute,ours` or `all`.
#[derive(Clone, Debug)]
pub struct StrategyList(pub Vec<Strategy>);

fn parse_strategies(s: &str) -> std::result::Result<StrategyList, String> {
    if s.trim() == "all" {
        return Ok(StrategyList(Strategy::ALL.to_vec()));
    }
    let mut v = Vec::new();
    for p in s.split(',') {
        let k = Strategy::parse(p)?;
        if !v.contains(&k) {
            v.push(k);
        }
    }
    Ok(StrategyList(v))
}

fn parse_probability(s: &str) -> std::result::Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(v) if (0.0..=1.0).contains(&v) => Ok(v),
        _ => Err(format!("`{s}` is not a probability in 0..=1")),
    }
}

fn parse_positive(s: &str) -> std::result::Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 => Ok(v),
        _ => Err(format!("`{s}` is not a positive number")),
    }
}

#[derive(Debug, Args)]
pub struct ContextsArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Contexts in the main trace.
    #[arg(long, env = "GPU_OFFLOAD_CONTEXTS", default_value_t = 6, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub contexts: u32,
    /// Contexts whose KV the device holds at once: the slots, as `serve --parallel` (on a
    /// budgeted device --gpu-mem must hold them beside the weights).
    #[arg(long, env = "GPU_OFFLOAD_RESIDENT", default_value_t = 2, value_parser = clap::value_parser!(u16).range(1..=256))]
    pub resident: u16,
    /// Calls in each trace.
    #[arg(long, env = "GPU_OFFLOAD_CALLS", default_value_t = 24, value_parser = clap::value_parser!(u32).range(1..))]
    pub calls: u32,
    /// Tokens of each context's conversation before the trace (the contexts grow from there).
    #[arg(long, env = "GPU_OFFLOAD_HISTORY_TOKENS", default_value_t = 1024, value_parser = clap::value_parser!(u32).range(1..))]
    pub history_tokens: u32,
    /// Tokens of a user turn: N or MIN-MAX (uniform).
    #[arg(long, env = "GPU_OFFLOAD_USER_TOKENS", default_value = "30-200", value_parser = parse_token_range)]
    pub user_tokens: (usize, usize),
    /// Tokens of an answer: N or MIN-MAX (uniform).
    #[arg(long, env = "GPU_OFFLOAD_ANSWER_TOKENS", default_value = "10-60", value_parser = parse_token_range)]
    pub answer_tokens: (usize, usize),
    /// Mean call arrivals per second (Poisson).
    #[arg(long, env = "GPU_OFFLOAD_RATE", default_value = "0.2", value_parser = parse_positive)]
    pub rate: f64,
    /// Probability that a call goes to the same context as the call before (a Markov chain);
    /// otherwise the context is drawn uniformly. 0: switching at random.
    #[arg(long, env = "GPU_OFFLOAD_STICKY", default_value = "0", value_parser = parse_probability)]
    pub sticky: f64,
    /// Seed of the trace (arrivals, contexts, turn lengths, where each context reads the corpus).
    #[arg(long, env = "GPU_OFFLOAD_SEED", default_value_t = 1)]
    pub seed: u64,
    /// Strategies to compare (comma-separated): recompute, whole-swap, chunked-swap,
    /// chunked-int8, ours; or all.
    #[arg(long, env = "GPU_OFFLOAD_STRATEGIES", default_value = "all", value_parser = parse_strategies)]
    pub strategies: StrategyList,
    /// Ours: KV chunk compression (off, int8, int4, int2, or a ratio of the int8 size such as
    /// 50%, as `serve --kv-compression`).
    #[arg(long, env = "GPU_OFFLOAD_KV_COMPRESSION", default_value = "50%", value_parser = crate::kv::Compression::parse)]
    pub kv_compression: crate::kv::Compression,
    /// DRAM for swapped KV, for each strategy's store (as `serve --kv-dram-mem`).
    #[arg(long, env = "GPU_OFFLOAD_KV_DRAM_MEM", default_value = "256M", value_parser = parse_bytes)]
    pub kv_dram_mem: u64,
    /// Directory for swap files (emptied and removed after each strategy) [default: OUT/kv-scratch]
    #[arg(long, env = "GPU_OFFLOAD_KV_DIR")]
    pub kv_dir: Option<PathBuf>,
    /// Numbers of contexts to sweep for "most contexts within the target" (comma-separated;
    /// the main trace's count is always a point). Empty: no sweep.
    #[arg(long, env = "GPU_OFFLOAD_SWEEP", default_value = "", value_parser = parse_counts)]
    pub sweep: CountList,
    /// Latency target of the sweep: p99 TTFT in seconds.
    #[arg(long, env = "GPU_OFFLOAD_TTFT_TARGET", default_value = "2", value_parser = parse_positive)]
    pub ttft_target: f64,
    /// Also run the trace with no context ever leaving the device and compare each call's
    /// logits after its user turn (greedy token, largest difference) for every strategy.
    #[arg(long, env = "GPU_OFFLOAD_CHECK")]
    pub check: bool,
    /// Text whose tokens make the conversations [default: moby-dick-eval.txt from
    /// scripts/fetch-models.sh when the model has a tokenizer, else seeded random ids]
    #[arg(long, env = "GPU_OFFLOAD_CORPUS")]
    pub corpus: Option<PathBuf>,
    /// Seeded random token ids instead of a corpus.
    #[arg(long, env = "GPU_OFFLOAD_RANDOM_CORPUS", conflicts_with = "corpus")]
    pub random_corpus: bool,
    /// Directory for contexts.json, contexts.md and contexts.svg (created if missing).
    #[arg(
        long,
        short = 'o',
        env = "GPU_OFFLOAD_OUT",
        default_value = "bench-contexts"
    )]
    pub out: PathBuf,
    /// Print contexts.json on stdout too.
    #[arg(long, env = "GPU_OFFLOAD_JSON")]
    pub json: bool,
}

impl ContextsArgs {
    /// The shape of a trace of `contexts` contexts under these flags.
    fn trace_config(&self, contexts: usize) -> TraceConfig {
        let a = self;
        TraceConfig {
            contexts,
            calls: a.calls as usize,
            history_tokens: a.history_tokens as usize,
            user_tokens: a.user_tokens,
            answer_tokens: a.answer_tokens,
            rate_per_s: a.rate,
            sticky: a.sticky,
            seed: a.seed,
        }
    }
}

/// What `bench contexts` wrote into `--out`: contexts.json's text, the Markdown, and the plot's
/// file name where one was drawn.
pub struct ContextsRun {
    pub json: String,
    pub markdown: String,
    pub plot: Option<&'static str>,
}

/// Run the benchmark of `a`.
pub fn run(a: &ContextsArgs) -> Result<ContextsRun> {
    check_flags(a)?;
    let kv_dir = a.kv_dir.clone().unwrap_or_else(|| a.out.join("kv-scratch"));

    let loaded = LoadedModel::load(&a.model)?;
    let spec = loaded.spec().clone();
    let (source, source_name) = token_source(a, &loaded)?;
    let (job, counts) = traces(a, &source);
    let ctx = job.ctx_size();
    if ctx > spec.max_context {
        bail!(
            "the contexts grow to {ctx} tokens but {} holds at most {}: lower --history-tokens, --calls or the turn lengths",
            spec.name,
            spec.max_context
        );
    }
    let resident = a.resident as usize;
    let running = loaded.start(
        &a.model,
        Job {
            ctx,
            sessions: resident,
            probe: true,
            batch: crate::footprint::MAX_BATCH.min(ctx),
            logit_rows: 1,
            // Recompute re-prefills whole conversations.
            prompt: ctx,
            kv_pool: None,
        },
    )?;
    let model_id = loaded.model_id()?;
    let set = RunSettings {
        resident,
        dram_budget: a.kv_dram_mem,
        compression: a.kv_compression,
        kv_dir: kv_dir.clone(),
        model_id,
        costs: crate::kv::CostModel {
            recompute_s_per_token: 0.0,
            load_s_per_chunk: 0.0,
            load_s_per_byte: 0.0,
            decode_s_per_value: 0.0,
        },
    };
    let progress = |m: &str| eprintln!("bench contexts: {m}");
    let (outcome, kv_type) = with_engine!(&running.engine, e => {
        (replay::run(e, ctx, &set, &job, &progress)?, e.kv_type())
    });
    std::fs::remove_dir(&kv_dir).ok();
    let kv_bytes_per_token = (2 * spec.n_layers * kv_type.row_bytes(spec.kv_dim())) as u64;
    let (speedups, ours_fastest) = speedups(&outcome.strategies);
    let most_contexts = most_contexts(&outcome.sweep, &job.strategies);
    let report = ContextsReport {
        schema: SCHEMA,
        gpu_offload_version: env!("CARGO_PKG_VERSION"),
        created_unix_s: unix_now(),
        model: ModelInfo {
            name: spec.name.clone(),
            path: loaded.path.display().to_string(),
            n_layers: spec.n_layers,
            kv_dim: spec.kv_dim(),
            max_context: spec.max_context,
            kv_type: format!("{kv_type:?}").to_lowercase(),
            kv_bytes_per_token,
        },
        device: DeviceInfo {
            kind: device_of(&running).into(),
            gpu_mem: a.model.budget.gpu_mem,
            threads: threads_of(&a.model),
        },
        settings: Settings {
            trace: job.main.cfg.clone(),
            resident,
            ctx_size: ctx,
            dram_budget: a.kv_dram_mem,
            compression: format!("{:?}", a.kv_compression),
            kv_dir: kv_dir.display().to_string(),
            tokens: source_name,
            ttft_target_s: a.ttft_target,
            sweep_contexts: counts,
            check: a.check,
        },
        cost_model: CostInfo {
            recompute_s_per_token: outcome.costs.recompute_s_per_token,
            load_s_per_chunk: outcome.costs.load_s_per_chunk,
            load_s_per_byte: outcome.costs.load_s_per_byte,
            decode_s_per_value: outcome.costs.decode_s_per_value,
        },
        strategies: outcome.strategies,
        speedups,
        ours_fastest,
        sweep: outcome.sweep,
        most_contexts,
        notes: notes(),
    };
    write_report(&report, a)
}

/// Flags first: nothing heavy runs before bad input is refused.
fn check_flags(a: &ContextsArgs) -> Result<()> {
    if a.model.ctx_size.is_some() {
        bail!(
            "bench contexts sizes each slot to the longest context of its traces: drop --ctx-size"
        );
    }
    if a.strategies.0.is_empty() {
        bail!("--strategies: name at least one strategy");
    }
    a.trace_config(a.contexts as usize)
        .validate()
        .map_err(anyhow::Error::msg)?;
    writable_dir(&a.out)?;
    Ok(())
}

/// Where the conversations' tokens come from (`--random-corpus`, `--corpus`, the default
/// corpus when the model has a tokenizer, else seeded random ids) and its name in the report.
fn token_source(a: &ContextsArgs, loaded: &LoadedModel) -> Result<(TokenSource, String)> {
    let spec = loaded.spec();
    let (source, source_name) = if a.random_corpus {
        (
            TokenSource::Random {
                vocab: spec.vocab_size,
            },
            "seeded random ids".to_string(),
        )
    } else {
        let default = crate::model::models_dir().join("moby-dick-eval.txt");
        match (&a.corpus, &loaded.tokenizer) {
            (Some(p), None) => bail!(
                "--corpus {}: {} has no tokenizer (use --random-corpus)",
                p.display(),
                loaded.path.display()
            ),
            (None, None) => (
                TokenSource::Random {
                    vocab: spec.vocab_size,
                },
                "seeded random ids (the model has no tokenizer)".to_string(),
            ),
            (None, Some(_)) if !default.exists() => (
                TokenSource::Random {
                    vocab: spec.vocab_size,
                },
                format!("seeded random ids ({} is missing)", default.display()),
            ),
            (given, Some(tok)) => {
                let (path, text) = read_corpus(given.as_deref(), "moby-dick-eval.txt")?;
                let ids = tok
                    .encode(&text, false, false)
                    .with_context(|| format!("cannot tokenize {}", path.display()))?;
                if ids.is_empty() {
                    bail!("corpus {} has no tokens", path.display());
                }
                (TokenSource::Corpus(ids), path.display().to_string())
            }
        }
    };
    Ok((source, source_name))
}

/// The main trace and the sweep's (one per other `--sweep` count, sorted, each once), as the
/// job to replay; and the sweep's counts.
fn traces(a: &ContextsArgs, source: &TokenSource) -> (replay::Job, Vec<usize>) {
    let main = Trace::generate(&a.trace_config(a.contexts as usize), source);
    let mut counts: Vec<usize> = a.sweep.0.clone();
    counts.sort_unstable();
    counts.dedup();
    let sweep: Vec<Trace> = counts
        .iter()
        .filter(|&&n| n != a.contexts as usize)
        .map(|&n| Trace::generate(&a.trace_config(n), source))
        .collect();
    let job = replay::Job {
        main,
        sweep,
        strategies: a.strategies.0.clone(),
        check: a.check,
        ttft_target_s: a.ttft_target,
    };
    (job, counts)
}

/// contexts.json, the plot and contexts.md into `--out`, each written atomically.
fn write_report(report: &ContextsReport, a: &ContextsArgs) -> Result<ContextsRun> {
    let write = |name: &str, bytes: &[u8]| {
        let p = a.out.join(name);
        crate::fsutil::write_atomic(&p, bytes)
            .with_context(|| format!("cannot write {}", p.display()))
    };
    let json = serde_json::to_string_pretty(report)?;
    write("contexts.json", json.as_bytes())?;
    let plot = match plot::contexts_svg(report) {
        Ok(svg) => {
            write("contexts.svg", svg.as_bytes())?;
            Some("contexts.svg")
        }
        Err(e) => {
            eprintln!("warning: {e}");
            None
        }
    };
    let md = report.markdown(plot);
    write("contexts.md", md.as_bytes())?;
    Ok(ContextsRun {
        json,
        markdown: md,
        plot,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_ranges_counts_and_strategies_parse_or_say_why_not() {
        assert_eq!(parse_token_range("30-200"), Ok((30, 200)));
        assert_eq!(parse_token_range("12"), Ok((12, 12)));
        for bad in ["0-4", "9-3", "x", "4-"] {
            assert!(parse_token_range(bad).is_err(), "{bad}");
        }
        assert!(parse_counts("").unwrap().0.is_empty());
        assert!(parse_counts("none").unwrap().0.is_empty());
        assert_eq!(parse_counts("2, 8").unwrap().0, [2, 8]);
        assert!(parse_counts("2,0").is_err());
        assert_eq!(parse_strategies("all").unwrap().0, Strategy::ALL);
        assert_eq!(
            parse_strategies("ours,recompute,ours").unwrap().0,
            [Strategy::Ours, Strategy::Recompute]
        );
        assert!(
            parse_strategies("fast")
                .unwrap_err()
                .contains("not a strategy")
        );
        assert!(parse_probability("1.5").is_err() && parse_positive("0").is_err());
    }
}
