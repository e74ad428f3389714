//! Perplexity the way llama.cpp measures it, so figures compare: the token stream is cut into
//! chunks of `ctx` tokens, each evaluated in a fresh context (its first token replaced by BOS when
//! the model uses one), and only the second half of each chunk is scored, so every scored token
//! has at least `ctx / 2` tokens of context.

use serde::Serialize;

use super::{Engine, EngineError, Logits, Result};
use crate::backend::Backend;

#[derive(Clone, Debug, Serialize)]
pub struct Perplexity {
    pub ppl: f64,
    /// Standard error of the perplexity estimate (delta method over per-token NLL).
    pub ppl_std_err: f64,
    pub mean_nll: f64,
    pub tokens_scored: usize,
    pub chunks: usize,
    pub ctx: usize,
}

/// Negative log-likelihood of `target` under `logits`, in f64.
pub fn nll(logits: &[f32], target: u32) -> f64 {
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) as f64;
    let sum: f64 = logits.iter().map(|&v| (v as f64 - max).exp()).sum();
    max + sum.ln() - logits[target as usize] as f64
}

/// Score `tokens` in chunks of `ctx`; `on_chunk(i, running_ppl)` reports progress.
pub fn perplexity<B: Backend>(
    engine: &Engine<B>,
    tokens: &[u32],
    ctx: usize,
    bos: Option<u32>,
    max_chunks: Option<usize>,
    on_chunk: &mut dyn FnMut(usize, f64),
) -> Result<Perplexity> {
    if ctx < 4 {
        return Err(EngineError::ContextFull { needed: 4, ctx });
    }
    let available = tokens.len() / ctx;
    let chunks = max_chunks.map_or(available, |m| m.min(available));
    if chunks == 0 {
        return Err(EngineError::ContextFull {
            needed: ctx,
            ctx: tokens.len(),
        });
    }
    let vocab = engine.spec().vocab_size;
    let first = ctx / 2;
    let mut nlls = Vec::with_capacity(chunks * (ctx - first));
    let mut session = engine.new_session(ctx)?;
    for c in 0..chunks {
        let mut chunk = tokens[c * ctx..(c + 1) * ctx].to_vec();
        if let Some(b) = bos {
            chunk[0] = b;
        }
        session.truncate(0);
        let logits = engine.forward(&mut session, &chunk, Logits::All)?;
        for j in first..ctx - 1 {
            let row = &logits[j * vocab..(j + 1) * vocab];
            nlls.push(nll(row, tokens[c * ctx + j + 1]));
        }
        on_chunk(c, mean(&nlls).exp());
    }
    let m = mean(&nlls);
    let var = nlls.iter().map(|v| (v - m).powi(2)).sum::<f64>() / (nlls.len().max(2) - 1) as f64;
    let std_err_nll = (var / nlls.len() as f64).sqrt();
    Ok(Perplexity {
        ppl: m.exp(),
        ppl_std_err: m.exp() * std_err_nll,
        mean_nll: m,
        tokens_scored: nlls.len(),
        chunks,
        ctx,
    })
}

fn mean(v: &[f64]) -> f64 {
    if v.is_empty() {
        0.0
    } else {
        v.iter().sum::<f64>() / v.len() as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uniform_logits_give_log_vocab() {
        let l = vec![0.5f32; 8];
        assert!((nll(&l, 3) - (8f64).ln()).abs() < 1e-12);
    }
}
