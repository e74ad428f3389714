//! `gpu-offload perplexity`: perplexity over a text file (llama.cpp's method, see
//! `engine::perplexity`).

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Args;

use crate::engine::perplexity::perplexity;
use crate::runtime::{Job, with_engine};
use crate::runtime::{LoadedModel, ModelArgs};

#[derive(Debug, Args)]
pub struct PerplexityArgs {
    #[command(flatten)]
    pub model: ModelArgs,

    /// Text file to score.
    #[arg(long, short = 'f', env = "GPU_OFFLOAD_FILE")]
    pub file: PathBuf,

    /// Tokens per chunk.
    #[arg(long, env = "GPU_OFFLOAD_CTX", default_value_t = 512, value_parser = clap::value_parser!(u32).range(4..))]
    pub ctx: u32,

    /// Score at most this many chunks.
    #[arg(long, env = "GPU_OFFLOAD_CHUNKS")]
    pub chunks: Option<usize>,

    /// Print the result as JSON.
    #[arg(long, env = "GPU_OFFLOAD_JSON")]
    pub json: bool,
}

pub fn run(args: PerplexityArgs) -> Result<()> {
    let text = std::fs::read_to_string(&args.file)
        .with_context(|| format!("cannot read {}", args.file.display()))?;
    let loaded = LoadedModel::load(&args.model)?;
    let tok = loaded.tokenizer()?;
    let ctx = args.ctx as usize;
    let max = loaded.spec().max_context;
    if ctx > max {
        bail!("--ctx {ctx} exceeds the model's maximum context of {max} tokens");
    }
    let tokens = tok.encode(&text, false, false)?;
    if tokens.len() < ctx {
        bail!(
            "{} has {} tokens; scoring needs at least one chunk of --ctx {ctx} tokens",
            args.file.display(),
            tokens.len()
        );
    }
    let running = loaded.start(&args.model, Job::single(ctx, ctx, ctx))?;
    let t0 = Instant::now();
    let quiet = args.json;
    let mut on_chunk = |i: usize, ppl: f64| {
        if !quiet {
            eprint!("[{}]{ppl:.4} ", i + 1);
        }
    };
    let result = with_engine!(&running.engine, e => {
        perplexity(e, &tokens, ctx, tok.bos(), args.chunks, &mut on_chunk)?
    });
    let secs = t0.elapsed().as_secs_f64();
    let mut out = std::io::stdout().lock();
    if args.json {
        let mut v = serde_json::to_value(&result)?;
        v["seconds"] = secs.into();
        writeln!(out, "{v}")?;
    } else {
        eprintln!();
        writeln!(
            out,
            "perplexity {:.4} ± {:.4} over {} tokens ({} chunks of {}), {:.1} s",
            result.ppl, result.ppl_std_err, result.tokens_scored, result.chunks, result.ctx, secs
        )?;
    }
    Ok(())
}
