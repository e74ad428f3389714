//! The generation loop: prefill the prompt, then sample and decode one token at a time until a
//! stop condition, reporting each token as it is chosen.

use std::time::Instant;

use serde::Serialize;

use super::sampler::{Sampler, SamplerParams};
use super::{Engine, Logits, Result, Session};
use crate::backend::Backend;

#[derive(Clone, Debug)]
pub struct GenerateParams {
    /// New tokens to produce at most.
    pub max_tokens: usize,
    pub sampler: SamplerParams,
    /// Stop at the model's end-of-generation tokens.
    pub stop_at_eog: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    /// `max_tokens` reached.
    Length,
    /// The model produced an end-of-generation token (not included in the output).
    EndOfGeneration,
    /// The session's context is full.
    ContextFull,
    /// The token callback asked to stop.
    Cancelled,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct Timings {
    pub prompt_tokens: usize,
    pub prefill_s: f64,
    /// Single-token forward passes after the prefill.
    pub decode_steps: usize,
    pub decode_s: f64,
}

impl Timings {
    pub fn prefill_tokens_per_s(&self) -> f64 {
        rate(self.prompt_tokens, self.prefill_s)
    }

    pub fn decode_tokens_per_s(&self) -> f64 {
        rate(self.decode_steps, self.decode_s)
    }
}

fn rate(n: usize, s: f64) -> f64 {
    if s > 0.0 { n as f64 / s } else { 0.0 }
}

#[derive(Clone, Debug)]
pub struct Generation {
    pub tokens: Vec<u32>,
    pub stop: StopReason,
    pub timings: Timings,
}

/// Generate after `prompt` (which is appended to what `session` holds). `on_token` sees each
/// new token and returns `false` to stop.
pub fn generate<B: Backend>(
    engine: &Engine<B>,
    session: &mut Session<B>,
    prompt: &[u32],
    params: &GenerateParams,
    is_eog: &dyn Fn(u32) -> bool,
    on_token: &mut dyn FnMut(u32) -> bool,
) -> Result<Generation> {
    let mut timings = Timings {
        prompt_tokens: prompt.len(),
        ..Default::default()
    };
    let mut sampler = Sampler::new(params.sampler.clone());
    let mut tokens = Vec::new();
    if params.max_tokens == 0 {
        return Ok(Generation {
            tokens,
            stop: StopReason::Length,
            timings,
        });
    }
    let t0 = Instant::now();
    let mut logits = engine.forward(session, prompt, Logits::Last)?;
    timings.prefill_s = t0.elapsed().as_secs_f64();

    let t1 = Instant::now();
    let stop = loop {
        let next = sampler.sample(&logits);
        if params.stop_at_eog && is_eog(next) {
            break StopReason::EndOfGeneration;
        }
        tokens.push(next);
        if !on_token(next) {
            break StopReason::Cancelled;
        }
        if tokens.len() >= params.max_tokens {
            break StopReason::Length;
        }
        if session.position() >= session.context_size() {
            break StopReason::ContextFull;
        }
        logits = engine.forward(session, &[next], Logits::Last)?;
        timings.decode_steps += 1;
    };
    timings.decode_s = t1.elapsed().as_secs_f64();
    Ok(Generation {
        tokens,
        stop,
        timings,
    })
}
