//! `gpu-offload logits`: the raw logits for a prompt, as JSON (`prompt_token_ids`, `logits`) or
//! as a top-N table.

use std::io::Write;

use anyhow::{Result, bail};
use clap::Args;
use serde_json::json;

use crate::engine::Logits;
use crate::runtime::{Job, with_engine};
use crate::runtime::{LoadedModel, ModelArgs, PromptArgs};

#[derive(Debug, Args)]
pub struct LogitsArgs {
    #[command(flatten)]
    pub model: ModelArgs,

    #[command(flatten)]
    pub prompt: PromptArgs,

    /// Logits of every position, not only the last.
    #[arg(long, env = "GPU_OFFLOAD_ALL_POSITIONS")]
    pub all_positions: bool,

    /// Print {"prompt_token_ids": [...], "logits": [[...vocab...], ...]}.
    #[arg(long, env = "GPU_OFFLOAD_JSON")]
    pub json: bool,

    /// Tokens per position in the table output.
    #[arg(long, env = "GPU_OFFLOAD_TOP", default_value_t = 10)]
    pub top: usize,
}

pub fn run(args: LogitsArgs) -> Result<()> {
    let loaded = LoadedModel::load(&args.model)?;
    let ids = loaded.prompt_ids(&args.prompt, None)?;
    if ids.is_empty() {
        bail!("the prompt is empty: no position to give logits for");
    }
    let ctx = loaded.context_for(&args.model, ids.len())?;
    if ids.len() > ctx {
        bail!(
            "the prompt has {} tokens but the context holds {ctx}",
            ids.len()
        );
    }
    let mode = if args.all_positions {
        Logits::All
    } else {
        Logits::Last
    };
    let running = loaded.start(
        &args.model,
        Job::single(
            ctx,
            ids.len(),
            if args.all_positions { ids.len() } else { 1 },
        ),
    )?;
    let logits = with_engine!(&running.engine, e => {
        let mut session = e.new_session(ctx)?;
        e.forward(&mut session, &ids, mode)?
    });
    let vocab = loaded.spec().vocab_size;
    let rows: Vec<&[f32]> = logits.chunks(vocab).collect();
    let mut out = std::io::stdout().lock();
    if args.json {
        writeln!(out, "{}", json!({"prompt_token_ids": ids, "logits": rows}))?;
        return Ok(());
    }
    let first = ids.len() - rows.len();
    for (i, row) in rows.iter().enumerate() {
        let pos = first + i;
        writeln!(out, "position {pos} (after token {}):", ids[pos])?;
        let mut order: Vec<usize> = (0..row.len()).collect();
        order.sort_by(|&a, &b| row[b].total_cmp(&row[a]));
        for &t in order.iter().take(args.top) {
            let piece = loaded
                .tokenizer
                .as_ref()
                .map(|tk| {
                    format!(
                        "{:?}",
                        String::from_utf8_lossy(&tk.token_bytes(t as u32, true))
                    )
                })
                .unwrap_or_default();
            writeln!(out, "  {t:>7} {:>12.5} {piece}", row[t])?;
        }
    }
    Ok(())
}
