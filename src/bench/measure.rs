//! The one place a model's speed is measured: time to first token, prefill and decode tokens/s
//! of an engine on a prompt, with the ledger snapshots that give bytes moved per token. Used by
//! `bench decode` and every cell of `bench suite`. Knows nothing of bounds or reports.

use std::sync::Arc;
use std::time::Instant;

use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

use crate::backend::Backend;
use crate::engine::trace::StepTrace;
use crate::engine::{Engine, GenerateParams, SamplerParams, generate};
use crate::footprint::LedgerSnapshot;

/// Tokens of the warm-up run's prompt (compiles kernels, fills caches, streams every layer once).
const WARMUP_PROMPT: usize = 64;

/// Medians over the measured repetitions, and the last repetition's ledger snapshots.
#[derive(Clone, Debug, Default)]
pub struct Measured {
    pub prompt_tokens: usize,
    /// Seconds from the start of the prefill until the first token was chosen.
    pub ttft_s: f64,
    pub prefill_tokens_per_s: f64,
    /// 0 when only one token was asked for.
    pub decode_tokens_per_s: f64,
    /// Single-token steps of the last repetition.
    pub decode_steps: usize,
    /// Device operations (kernels, on-device copies) run per decode step (last repetition),
    /// where the backend counts them (CUDA: launched, or replayed in a recorded step).
    pub device_ops_per_decode_step: Option<f64>,
    pub reps: usize,
    /// The ledger when the first token was chosen, and at the end (last repetition).
    pub after_prefill: LedgerSnapshot,
    pub end: LedgerSnapshot,
    /// Decode tokens/s of the traced repetition (with a trace).
    pub traced_decode_tokens_per_s: Option<f64>,
}

/// Generate `tokens` greedy tokens after `prompt` in a fresh session of `ctx` positions,
/// `reps` times after one short warm-up run; medians of the timings. `snapshot` reads the
/// device's ledger; `before_rep` runs before each repetition (untimed: a probe of the rates the
/// run is bounded by, taken in the same minutes). With `trace`, the last repetition's steps are
/// traced into it and, where there are two or more, the timings are the medians of the others:
/// tracing marks every phase (on CUDA two timing events each, driver calls inside the step they
/// time), so a traced step is slower than the step it explains
/// ([`Measured::traced_decode_tokens_per_s`] says by how much).
pub fn measure<B: Backend>(
    engine: &Engine<B>,
    ctx: usize,
    prompt: &[u32],
    tokens: usize,
    reps: usize,
    (snapshot, before_rep): (&dyn Fn() -> LedgerSnapshot, &mut dyn FnMut()),
    trace: Option<Arc<StepTrace>>,
) -> crate::engine::Result<Measured> {
    let run = |prompt: &[u32], tokens: usize| {
        let params = GenerateParams {
            max_tokens: tokens,
            sampler: SamplerParams::greedy(),
            stop_at_eog: false,
        };
        let mut first = None;
        let mut ops_at_first = None;
        let mut session = engine.new_session(ctx)?;
        // A traced run keeps its own steps only.
        if let Some(t) = engine.trace() {
            t.clear();
        }
        let t0 = Instant::now();
        let g = generate(
            engine,
            &mut session,
            prompt,
            &params,
            &|_| false,
            &mut |_| {
                if first.is_none() {
                    first = Some((t0.elapsed().as_secs_f64(), snapshot()));
                    ops_at_first = engine.backend().device_ops_run();
                }
                true
            },
        )?;
        let (ttft, after) = first.unwrap_or_default();
        let steps = g.timings.decode_steps;
        let ops = match (ops_at_first, engine.backend().device_ops_run()) {
            (Some(a), Some(b)) if steps > 0 => Some((b - a) as f64 / steps as f64),
            _ => None,
        };
        Ok::<_, crate::engine::EngineError>((ttft, g.timings, after, snapshot(), ops))
    };
    let reps = reps.max(1);
    let traced = trace.is_some();
    engine.set_trace(None)?;
    let warm = prompt.len().min(WARMUP_PROMPT);
    run(&prompt[..warm], tokens.min(2))?;
    let mut out = Measured {
        prompt_tokens: prompt.len(),
        reps,
        ..Default::default()
    };
    let (mut ttft, mut prefill, mut decode) = (Vec::new(), Vec::new(), Vec::new());
    for rep in 0..reps {
        before_rep();
        let traced_rep = traced && rep + 1 == reps;
        if traced_rep {
            engine.set_trace(trace.clone())?;
        }
        let (t, timings, after, end, ops) = run(prompt, tokens)?;
        if traced_rep {
            engine.set_trace(None)?;
            out.traced_decode_tokens_per_s = Some(timings.decode_tokens_per_s());
        }
        if !traced_rep || reps == 1 {
            ttft.push(t);
            prefill.push(timings.prefill_tokens_per_s());
            decode.push(timings.decode_tokens_per_s());
        }
        // The ledger's snapshots are the last repetition's: the traced one's phases are
        // checked against them.
        out.decode_steps = timings.decode_steps;
        out.device_ops_per_decode_step = ops;
        out.after_prefill = after;
        out.end = end;
    }
    out.ttft_s = median(ttft);
    out.prefill_tokens_per_s = median(prefill);
    out.decode_tokens_per_s = median(decode);
    Ok(out)
}

/// The median (the upper one for an even count); NaN for none.
pub fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Random prompt ids (seeded, so every run and every cell sees the same prompt).
pub fn random_prompt(n: usize, vocab: usize) -> Vec<u32> {
    random_prompt_seeded(n, vocab, 1)
}

/// Random prompt ids from `seed` (ids 3.. : clear of the usual BOS/EOS/unknown).
pub fn random_prompt_seeded(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut rng = StdRng::seed_from_u64(seed);
    let hi = (vocab as u32).max(4);
    (0..n).map(|_| rng.random_range(3..hi)).collect()
}
