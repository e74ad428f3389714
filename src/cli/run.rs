//! `gpu-offload run`: one-shot generation, streamed to stdout or printed as one JSON object.

use std::io::Write;

use anyhow::{Context, Result, bail};
use clap::Args;
use serde_json::json;

use crate::engine::{GenerateParams, SamplerParams, generate};
use crate::model::tokenizer::TextStream;
use crate::runtime::{Job, with_engine};
use crate::runtime::{LoadedModel, ModelArgs, PromptArgs};

#[derive(Debug, Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub model: ModelArgs,

    #[command(flatten)]
    pub prompt: PromptArgs,

    /// Wrap the prompt as a user message in the model's chat template.
    #[arg(long, env = "GPU_OFFLOAD_CHAT")]
    pub chat: bool,

    /// System message for --chat.
    #[arg(long, env = "GPU_OFFLOAD_SYSTEM", requires = "chat")]
    pub system: Option<String>,

    /// New tokens to generate at most.
    #[arg(
        long,
        short = 'n',
        env = "GPU_OFFLOAD_MAX_TOKENS",
        default_value_t = 256
    )]
    pub max_tokens: usize,

    #[command(flatten)]
    pub sampling: SamplingArgs,

    /// Keep generating past end-of-generation tokens (benchmarks, parity checks).
    #[arg(long, env = "GPU_OFFLOAD_IGNORE_EOS")]
    pub ignore_eos: bool,

    /// Print one JSON object: prompt_token_ids, token_ids, text, stop_reason, timings.
    #[arg(long, env = "GPU_OFFLOAD_JSON")]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct SamplingArgs {
    /// Sampling temperature; 0 = greedy [default: 0.8 for run; 0 for prefill]
    #[arg(long, env = "GPU_OFFLOAD_TEMPERATURE", allow_negative_numbers = true)]
    pub temperature: Option<f32>,

    /// Sample from the k most likely tokens (0 = all).
    #[arg(long, env = "GPU_OFFLOAD_TOP_K", default_value_t = 40)]
    pub top_k: usize,

    /// Nucleus sampling: smallest set of tokens whose probability reaches p.
    #[arg(
        long,
        env = "GPU_OFFLOAD_TOP_P",
        default_value_t = 0.95,
        allow_negative_numbers = true
    )]
    pub top_p: f32,

    /// Drop tokens less likely than min-p times the most likely one.
    #[arg(
        long,
        env = "GPU_OFFLOAD_MIN_P",
        default_value_t = 0.05,
        allow_negative_numbers = true
    )]
    pub min_p: f32,

    /// Random seed [default: from the clock for run; 0 for prefill]
    #[arg(long, env = "GPU_OFFLOAD_SEED")]
    pub seed: Option<u64>,
}

impl SamplingArgs {
    /// The sampler the flags ask for, with the command's default temperature and seed where
    /// they are not given.
    pub fn params(&self, temperature: f32, seed: impl FnOnce() -> u64) -> Result<SamplerParams> {
        let p = SamplerParams {
            temperature: self.temperature.unwrap_or(temperature),
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            seed: self.seed.unwrap_or_else(seed),
        };
        if let Err(msg) = p.validate() {
            bail!("invalid sampling flag: {msg}");
        }
        Ok(p)
    }
}

pub fn run(args: RunArgs) -> Result<()> {
    let sampler = args.sampling.params(0.8, || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
    })?;
    let loaded = LoadedModel::load(&args.model)?;
    let chat = args.chat.then_some(args.system.as_deref());
    let prompt = loaded.prompt_ids(&args.prompt, chat)?;
    if prompt.is_empty() {
        bail!("the prompt is empty (and the model adds no BOS token): nothing to continue from");
    }
    // Checked: `-n 18446744073709551615` once wrapped to a context of 2.
    let needed = prompt.len().checked_add(args.max_tokens).with_context(|| {
        format!(
            "-n {}: the prompt's {} tokens and that many new ones overflow a count; ask for at most the model's context of {} tokens",
            args.max_tokens,
            prompt.len(),
            loaded.spec().max_context
        )
    })?;
    let ctx = loaded.context_for(&args.model, needed)?;
    if prompt.len() > ctx {
        bail!(
            "the prompt has {} tokens but the context holds {ctx} (the model's maximum is {}; see --ctx-size)",
            prompt.len(),
            loaded.spec().max_context
        );
    }
    let running = loaded.start(&args.model, Job::single(ctx, prompt.len(), 1))?;
    let params = GenerateParams {
        max_tokens: args.max_tokens,
        sampler,
        stop_at_eog: !args.ignore_eos,
    };
    let tok = loaded.tokenizer.as_ref();
    let is_eog = |id: u32| tok.is_some_and(|t| t.is_end_of_generation(id));
    let mut stream = tok.map(TextStream::new);
    let mut stdout = std::io::stdout().lock();
    let mut write_err = None;
    let mut text = String::new();
    // Traffic counters right after the prefill (the first token comes from it).
    let mut after_prefill = None;
    let mut on_token = |id: u32| {
        if after_prefill.is_none() {
            after_prefill = Some(running.snapshot());
        }
        let piece = match &mut stream {
            Some(s) => s.push(id),
            None => format!("{id} "),
        };
        if args.json {
            text.push_str(&piece);
            return true;
        }
        if let Err(e) = stdout
            .write_all(piece.as_bytes())
            .and_then(|_| stdout.flush())
        {
            write_err = Some(e);
            return false;
        }
        true
    };
    let generation = with_engine!(&running.engine, e => {
        let mut session = e.new_session(ctx)?;
        generate(e, &mut session, &prompt, &params, &is_eog, &mut on_token)?
    });
    let end = running.snapshot();
    if let Some(e) = write_err {
        if e.kind() != std::io::ErrorKind::BrokenPipe {
            return Err(e.into());
        }
        return Ok(());
    }
    let t = &generation.timings;
    if args.json {
        if let Some(s) = &mut stream {
            text.push_str(&s.finish());
        }
        if tok.is_none() {
            text.clear();
        }
        let out = json!({
            "prompt_token_ids": prompt,
            "token_ids": generation.tokens,
            "text": text,
            "stop_reason": generation.stop,
            "timings": {
                "load_s": running.load_s,
                "prefill_tokens_per_s": t.prefill_tokens_per_s(),
                "decode_tokens_per_s": t.decode_tokens_per_s(),
            },
            "memory": running.memory_json(after_prefill.unwrap_or_default(), end, prompt.len(), t.decode_steps),
        });
        writeln!(stdout, "{out}")?;
    } else {
        if let Some(s) = &mut stream {
            write!(stdout, "{}", s.finish())?;
        }
        writeln!(stdout)?;
        eprintln!(
            "[{} prompt tokens at {:.1} tok/s, {} generated at {:.1} tok/s, stop: {:?}]",
            t.prompt_tokens,
            t.prefill_tokens_per_s(),
            generation.tokens.len(),
            t.decode_tokens_per_s(),
            generation.stop
        );
    }
    Ok(())
}
