//! `bench decode`: a model end to end (TTFT, prefill and decode tokens/s) against the bound of
//! the resource it must move bytes through (device memory, PCIe, DRAM or SSD) and the plan's
//! prediction; with `--sessions N`, N sequences decoded together against one alone.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Result, bail};
use clap::Args;
use serde_json::{Value, json};

use crate::bench::bounds::{self, AboveBound, Bound, Rates};
use crate::bench::measure::{self, Measured, measure, random_prompt, random_prompt_seeded};
use crate::bench::running::{device_of, threads_of, traffic_of};
use crate::plan::HardwareProfile;
use crate::runtime::{Job, LoadedModel, ModelArgs, with_engine};

#[derive(Debug, Args)]
pub struct DecodeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Prompt length in tokens (random ids).
    #[arg(long, env = "GPU_OFFLOAD_PROMPT_TOKENS", default_value_t = 32)]
    pub prompt_tokens: usize,
    /// Tokens to decode.
    #[arg(long, short = 'n', env = "GPU_OFFLOAD_TOKENS", default_value_t = 64)]
    pub tokens: usize,
    /// Repetitions (the median is reported).
    #[arg(long, env = "GPU_OFFLOAD_REPS", default_value_t = 3)]
    pub reps: usize,
    /// Decode this many sequences at once (continuous batching: one step evaluates a token of
    /// each), beside one sequence alone in the same run: aggregate tokens/s of both.
    #[arg(long, env = "GPU_OFFLOAD_SESSIONS", default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=512))]
    pub sessions: u16,
    #[arg(long, env = "GPU_OFFLOAD_JSON")]
    pub json: bool,
}

/// The rates bounds divide by: `hardware`'s figures when given, else measured now on
/// `device` (SSD only when `ssd_dir` is given).
fn rates_for(
    hardware: Option<&str>,
    emulate: Option<&str>,
    device: &str,
    threads: usize,
    ssd_dir: Option<&Path>,
) -> Result<Rates> {
    let rates = match hardware {
        Some(h) => Rates::from_profile(&HardwareProfile::load(h).map_err(anyhow::Error::msg)?),
        None => match device {
            "cuda" => {
                bounds::measure_gpu(threads, ssd_dir)
                    .map_err(anyhow::Error::msg)?
                    .0
            }
            _ => bounds::measure_sim(threads, ssd_dir),
        },
    };
    Ok(match emulate {
        Some(card) => rates.emulating(&HardwareProfile::load(card).map_err(anyhow::Error::msg)?),
        None => rates,
    })
}

/// The directory offloaded weights are read from (the SSD the bound's SSD rate is of).
fn store_dir_for(model: &Path) -> PathBuf {
    if crate::store::Store::is_store(model) {
        model.to_path_buf()
    } else {
        crate::model::models_dir()
    }
}

/// What `bench decode` measured: one sequence, or `--sessions N` together beside one alone.
pub enum DecodeOutcome {
    Single(Box<DecodeRun>),
    Sessions(SessionsRun),
}

/// One sequence decoded, beside its bound and the plan's prediction.
pub struct DecodeRun {
    pub model: String,
    /// "cpu", "sim" or "cuda".
    pub device: &'static str,
    pub measured: Measured,
    /// Rows the prompt's steps took (a longer prompt runs layer by layer in groups of this many).
    pub prefill_step: usize,
    pub bound: Bound,
    pub rates: Rates,
    pub predicted: Option<f64>,
    /// Whether decode steps are recorded (`--cuda-graphs`, on by default on CUDA), and how many
    /// were recorded and replayed over all repetitions.
    pub cuda_graphs: bool,
    pub recorded: u64,
    pub replayed: u64,
    /// Everything, as `--json` prints it.
    pub json: Value,
}

/// `--sessions N` together against one sequence alone.
pub struct SessionsRun {
    pub model: String,
    pub device: &'static str,
    pub sessions: usize,
    /// Decode tokens/s of one sequence alone, and of all of them together.
    pub single_tokens_per_s: f64,
    pub aggregate_tokens_per_s: f64,
    /// Everything, as `--json` prints it.
    pub json: Value,
}

/// Load the model of `a` and measure it.
pub fn run(a: &DecodeArgs) -> Result<DecodeOutcome> {
    if a.tokens < 2 || a.prompt_tokens == 0 || a.reps == 0 {
        bail!("--tokens must be at least 2; --prompt-tokens and --reps at least 1");
    }
    if a.sessions > 1 {
        return run_sessions(a).map(DecodeOutcome::Sessions);
    }
    run_single(a).map(|r| DecodeOutcome::Single(Box::new(r)))
}

/// One sequence: TTFT, prefill and decode tokens/s, the bound and what the tiers moved.
fn run_single(a: &DecodeArgs) -> Result<DecodeRun> {
    let loaded = LoadedModel::load(&a.model)?;
    let spec = loaded.spec().clone();
    let ctx = a.prompt_tokens + a.tokens;
    if ctx > spec.max_context {
        bail!(
            "{ctx} positions exceed the model's maximum of {}",
            spec.max_context
        );
    }
    let prompt = random_prompt(a.prompt_tokens, spec.vocab_size);
    let running = loaded.start(&a.model, Job::single(ctx, a.prompt_tokens, 1))?;
    let m = with_engine!(&running.engine, e => {
        measure(e, ctx, &prompt, a.tokens, a.reps, &|| running.snapshot())?
    });
    let memory = running.memory_json(m.after_prefill, m.end, prompt.len(), m.decode_steps);
    let device = device_of(&running);
    let traffic = traffic_of(&running, prompt.len(), m.decode_steps);
    let ssd_dir = (traffic.ssd_read_bytes > 0.0).then(|| store_dir_for(&loaded.path));
    let rates = rates_for(
        a.model.budget.hardware.as_deref(),
        a.model.budget.emulate.as_deref(),
        device,
        threads_of(&a.model),
        ssd_dir.as_deref(),
    )?;
    let bound = Bound::of(&traffic, &rates);
    let predicted = match (&running.hybrid, &running.units) {
        (Some(h), _) => Some(h.plan.predicted_tokens_per_s),
        (_, Some(u)) => Some(u.plan.predicted_tokens_per_s),
        _ => running.plan.as_ref().map(|p| p.prediction.tokens_per_s),
    };
    // What the cache units moved, against what the plan expected per token.
    let units = running.units.as_ref().map(|u| {
        let [needed, loads, bytes] = u.traffic.snapshot();
        json!({"needed": needed, "loads": loads, "bytes": bytes,
               "hit_ratio": if needed == 0 { 1.0 } else { 1.0 - loads as f64 / needed as f64 },
               "expected_pcie_bytes_per_token": u.plan.per_token.pcie_bytes,
               "slots": u.plan.slots(), "device_bytes": u.plan.device.total})
    });
    // What the CPU read for cold neurons, against what the plan expected per token.
    let cold = running.hybrid.as_ref().map(|h| {
        let [bytes, candidates, active, units] = h.traffic.snapshot();
        json!({"cpu_bytes_total": bytes, "candidates": candidates, "active": active,
               "down_blocks": units, "expected_cpu_bytes_per_token": h.plan.per_token.cpu_bytes,
               "hot_neurons": h.plan.layers.iter().map(|l| l.neurons).sum::<usize>(),
               "device_bytes": h.plan.device.total})
    });
    // Decode steps recorded (`--cuda-graphs`) and replayed over all repetitions.
    let (recorded, replayed) = with_engine!(&running.engine, e => e.recorded_steps());
    // On by default on CUDA: whether this engine records, not whether the flag was given.
    let cuda_graphs = with_engine!(&running.engine, e => e.records_decode_steps());
    // Rows the prompt's steps took (a longer prompt runs layer by layer in groups of this many).
    let prefill_step = with_engine!(&running.engine, e => e.prefill().group);
    let out = json!({
        "model": spec.name, "device": device, "prompt_tokens": a.prompt_tokens, "decode_tokens": a.tokens,
        "prefill_step_rows": prefill_step.min(a.prompt_tokens),
        "cuda_graphs": {"on": cuda_graphs, "recorded": recorded, "replayed": replayed},
        "programmatic_launch": a.model.programmatic_launch,
        "device_ops_per_decode_step": m.device_ops_per_decode_step,
        "reps": a.reps, "ttft_s": m.ttft_s, "prefill_tokens_per_s": m.prefill_tokens_per_s,
        "decode_tokens_per_s": m.decode_tokens_per_s,
        "bound": format!("{} (bytes per token ÷ rate)", bound.limited_by),
        "bound_limited_by": bound.limited_by, "bound_tokens_per_s": bound.tokens_per_s,
        "bound_seconds": bound.seconds, "fraction_of_bound": m.decode_tokens_per_s / bound.tokens_per_s,
        "predicted_tokens_per_s": predicted, "rates": rates,
        "load_s": running.load_s, "memory": memory, "hybrid": cold, "cache_units": units,
    });
    Ok(DecodeRun {
        model: spec.name,
        device,
        measured: m,
        prefill_step,
        bound,
        rates,
        predicted,
        cuda_graphs,
        recorded,
        replayed,
        json: out,
    })
}

impl DecodeRun {
    /// An error when decode tokens/s are above the bound (beyond [`bounds::TOLERANCE`]): the
    /// bound is wrong.
    pub fn check_bound(&self) -> Result<(), AboveBound> {
        bounds::check(
            "decode (tokens/s)",
            self.measured.decode_tokens_per_s,
            &self.bound,
            &self.rates,
        )
    }
}

/// `bench decode --sessions N`: N sequences decoded together (one batched step per token of
/// each) against one alone, in one run on one engine: aggregate decode tokens/s of each.
fn run_sessions(a: &DecodeArgs) -> Result<SessionsRun> {
    let loaded = LoadedModel::load(&a.model)?;
    let spec = loaded.spec().clone();
    let n = a.sessions as usize;
    let ctx = a.prompt_tokens + a.tokens + 1;
    if ctx > spec.max_context {
        bail!(
            "{ctx} positions exceed the model's maximum of {}",
            spec.max_context
        );
    }
    let job = Job {
        sessions: n,
        logit_rows: n,
        ..Job::single(ctx, a.prompt_tokens.max(n), 1)
    };
    let running = loaded.start(&a.model, job)?;
    let prompts: Vec<Vec<u32>> = (0..n)
        .map(|i| random_prompt_seeded(a.prompt_tokens, spec.vocab_size, 100 + i as u64))
        .collect();
    let argmax = crate::engine::sampler::argmax;
    let (one, many) = with_engine!(&running.engine, e => {
        let mut one = Vec::new();
        let mut many = Vec::new();
        for _ in 0..a.reps {
            // One sequence alone.
            let mut s = e.new_session(ctx)?;
            let mut next = argmax(&e.forward(&mut s, &prompts[0], crate::engine::Logits::Last)?);
            let t0 = Instant::now();
            for _ in 0..a.tokens {
                next = argmax(&e.forward(&mut s, &[next], crate::engine::Logits::Last)?);
            }
            one.push(a.tokens as f64 / t0.elapsed().as_secs_f64());
            drop(s);
            // All of them together.
            let mut ss = Vec::with_capacity(n);
            let mut last = Vec::with_capacity(n);
            for p in &prompts {
                let mut s = e.new_session(ctx)?;
                last.push(argmax(&e.forward(&mut s, p, crate::engine::Logits::Last)?));
                ss.push(s);
            }
            let group = e.prefill().group;
            let t0 = Instant::now();
            for _ in 0..a.tokens {
                let mut calls: Vec<_> = ss.iter_mut().zip(&last).map(|(s, &t)| (s, t)).collect();
                let mut out = Vec::with_capacity(n);
                for c in calls.chunks_mut(group) {
                    out.extend(e.decode_many(c)?);
                }
                last = out.iter().map(|l| argmax(l)).collect();
            }
            many.push((n * a.tokens) as f64 / t0.elapsed().as_secs_f64());
        }
        (one, many)
    });
    let (one, many) = (measure::median(one), measure::median(many));
    let out = json!({
        "model": spec.name, "device": device_of(&running), "sessions": n,
        "prompt_tokens": a.prompt_tokens, "decode_tokens": a.tokens, "reps": a.reps,
        "single_decode_tokens_per_s": one, "aggregate_decode_tokens_per_s": many,
        "speedup": many / one,
        "prefill_layout": running.plan.as_ref().map(|p| p.prefill),
    });
    Ok(SessionsRun {
        model: spec.name,
        device: device_of(&running),
        sessions: n,
        single_tokens_per_s: one,
        aggregate_tokens_per_s: many,
        json: out,
    })
}
