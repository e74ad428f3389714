//! `bench decode`: a model end to end (TTFT, prefill and decode tokens/s) against the bound of
//! the resource it must move bytes through (device memory, PCIe, DRAM or SSD) and the plan's
//! prediction; with `--sessions N`, N sequences decoded together against one alone; with a list
//! (`--sessions 1,4,16`) or `--modes`, each count under each `--cold` mode, each run under the
//! plan for that count: measured aggregate tokens/s beside the plan's prediction.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Result, bail};
use clap::Args;
use serde_json::{Value, json};

use crate::backend::Backend;
use crate::bench::bounds::{self, AboveBound, Bound, Rates};
use crate::bench::measure::{self, Measured, measure, random_prompt, random_prompt_seeded};
use crate::bench::phases;
use crate::bench::running::{device_of, threads_of, traffic_of};
use crate::engine::Engine;
use crate::engine::trace::StepTrace;
use crate::plan::HardwareProfile;
use crate::plan::choice::Cold;
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
    /// each), beside one sequence alone in the same run: aggregate tokens/s of both. A list
    /// (e.g. 1,4,16) runs each count in turn, each under the plan made for that many
    /// sequences: measured aggregate tokens/s beside the plan's prediction.
    #[arg(long, env = "GPU_OFFLOAD_SESSIONS", value_delimiter = ',', default_value = "1", value_parser = clap::value_parser!(u16).range(1..=512))]
    pub sessions: Vec<u16>,
    /// Run each of these --cold modes in turn at every --sessions count (comma-separated:
    /// stream, split, cpu, gpu, auto; cpu and gpu need `gpu-offload profile`): each one's
    /// measured aggregate tokens/s beside its plan's prediction, a mode that cannot run at the
    /// budget reported as such [default: --cold alone]
    #[arg(long, env = "GPU_OFFLOAD_MODES", value_delimiter = ',', value_enum)]
    pub modes: Vec<Cold>,
    #[arg(long, env = "GPU_OFFLOAD_JSON")]
    pub json: bool,
    /// With --sparsity predicted: also measure the predictors' recall on this run's prompt and
    /// the tokens a CPU engine over the model loaded whole decodes after it (the oracle mask at
    /// the target they were trained for beside what they name, per layer), after the timed
    /// runs; in the JSON's `predictors.measured`.
    #[arg(long, env = "GPU_OFFLOAD_RECALL")]
    pub recall: bool,
    /// Write the per-phase trace of the last repetition's steps here (Chrome trace-event JSON:
    /// open it in Perfetto or chrome://tracing); one sequence only. With --json, the phases'
    /// totals per token are printed either way. With --reps 2 or more the traced repetition is
    /// left out of the tokens/s (tracing slows the steps it times).
    #[arg(long, env = "GPU_OFFLOAD_TRACE")]
    pub trace: Option<PathBuf>,
}

/// The rates bounds divide by: `hardware`'s figures when given, else measured now on
/// `device` (SSD only when `ssd_dir` is given; the budgeted device's `link` where it was
/// measured before the run).
fn rates_for(
    hardware: Option<&str>,
    emulate: Option<&str>,
    device: &str,
    threads: usize,
    (ssd_dir, link): (Option<&Path>, Option<f64>),
) -> Result<Rates> {
    let rates = match hardware {
        Some(h) => Rates::from_profile(&HardwareProfile::load(h).map_err(anyhow::Error::msg)?),
        None => match device {
            "cuda" => {
                bounds::measure_gpu(threads, ssd_dir)
                    .map_err(anyhow::Error::msg)?
                    .0
            }
            _ => bounds::measure_sim(threads, ssd_dir, link),
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

/// What `bench decode` measured: one sequence, `--sessions N` together beside one alone, or
/// each count of a list under each mode.
pub enum DecodeOutcome {
    Single(Box<DecodeRun>),
    Sessions(SessionsRun),
    Batches(BatchesRun),
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
    /// The plan's predicted aggregate tokens/s of the sessions together (offloaded runs).
    pub predicted_tokens_per_s: Option<f64>,
    /// Everything, as `--json` prints it.
    pub json: Value,
}

/// Load the model of `a` and measure it.
pub fn run(a: &DecodeArgs) -> Result<DecodeOutcome> {
    if a.tokens < 2 || a.prompt_tokens == 0 || a.reps == 0 {
        bail!("--tokens must be at least 2; --prompt-tokens and --reps at least 1");
    }
    match (a.sessions.as_slice(), a.modes.is_empty()) {
        ([], _) => bail!("--sessions: give at least one count, e.g. 1,4,16"),
        ([1], true) => run_single(a).map(|r| DecodeOutcome::Single(Box::new(r))),
        _ if a.trace.is_some() => {
            bail!("--trace traces one sequence: leave out --sessions N and --modes")
        }
        ([_], true) => run_sessions(a).map(DecodeOutcome::Sessions),
        _ => run_batches(a).map(DecodeOutcome::Batches),
    }
}

/// The predictors naming the neurons (`--sparsity predicted`), as the plan costs them: their
/// recall and share named on the profile's held-out tokens, their weights per step; with
/// `--recall`, their recall on this run's tokens, measured after the timed runs. None without.
fn predictors_json(
    a: &DecodeArgs,
    loaded: &LoadedModel,
    running: &crate::runtime::Running,
    prompt: &[u32],
) -> Result<Option<Value>> {
    let measured = if a.recall {
        let store = crate::runtime::store::open_store_for(&loaded.path)?;
        let name = loaded.path.display().to_string();
        let threads = a.model.threads.map_or(0, usize::from);
        Some(crate::runtime::profiling::measure_recall(
            &loaded.path,
            &store,
            &name,
            prompt,
            a.tokens,
            threads,
        )?)
    } else {
        None
    };
    let planned = running
        .hybrid
        .as_ref()
        .and_then(|h| h.plan.predictors.as_deref())
        .or(running
            .units
            .as_ref()
            .and_then(|u| u.plan.predictors.as_deref()));
    let summary = planned.and_then(crate::plan::cold::PredictorCost::summary);
    Ok(match (planned.zip(summary), &measured) {
        (Some((p, (weight_bytes, share, recall))), _) => Some(
            json!({"recall_held_out": recall, "predicted_share_held_out": share,
                   "weight_bytes_per_step": weight_bytes, "layers": p, "measured": measured}),
        ),
        (None, Some(m)) => Some(json!({ "measured": m })),
        (None, None) => None,
    })
}

/// The budgeted device's link, where the run's rates are measured (no `--hardware`, no
/// `--emulate`, which paces from the start): its copy engine's rate (one memcpy thread, as
/// [`bounds::measure_sim`] takes it), measured before the run, and the device held to it. Its
/// copies take that long by themselves; what its listed ops read in place crosses the same
/// link, and a CPU that reads faster than one thread copies would otherwise beat the bound the
/// run is checked against. `None` on the other devices.
fn hold_sim_link(running: &crate::runtime::Running, args: &ModelArgs) -> Result<Option<f64>> {
    let crate::runtime::AnyEngine::Sim(e) = &running.engine else {
        return Ok(None);
    };
    if args.budget.hardware.is_some() || args.budget.emulate.is_some() {
        return Ok(None);
    }
    let rate = bounds::sim_link_rate();
    e.backend().pace_copies(rate)?;
    Ok(Some(rate))
}

/// One sequence: TTFT, prefill and decode tokens/s, the bound and what the tiers moved.
fn run_single(a: &DecodeArgs) -> Result<DecodeRun> {
    if a.recall && a.model.sparsity != crate::runtime::SparsityMode::Predicted {
        bail!("--recall measures the predictors' recall: run with --sparsity predicted");
    }
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
    let link = hold_sim_link(&running, &a.model)?;
    // Phases are traced for --trace and --json: the last repetition's steps (the timings are
    // the other repetitions' where there are two or more).
    let trace = (a.json || a.trace.is_some()).then(|| StepTrace::new(running.ledger.clone()));
    // Measured rates take the host's DRAM rate from probes between the repetitions too.
    let live_dram = a.model.budget.hardware.is_none();
    let threads = threads_of(&a.model);
    let mut dram_probes = Vec::new();
    let mut probe = || {
        if live_dram {
            dram_probes.push(bounds::dram_read_rate(threads));
        }
    };
    let snapshot = || running.snapshot();
    let m = with_engine!(&running.engine, e => {
        measure(e, ctx, &prompt, a.tokens, a.reps, (&snapshot, &mut probe), trace.clone())?
    });
    let log = trace.as_ref().map(|t| t.log());
    let memory = running.memory_json(m.after_prefill, m.end, prompt.len(), m.decode_steps);
    let device = device_of(&running);
    let traffic = traffic_of(
        &running,
        prompt.len(),
        m.decode_steps,
        (&m.after_prefill, &m.end),
    );
    let ssd_dir = (traffic.ssd_read_bytes > 0.0).then(|| store_dir_for(&loaded.path));
    let rates = rates_for(
        a.model.budget.hardware.as_deref(),
        a.model.budget.emulate.as_deref(),
        device,
        threads,
        (ssd_dir.as_deref(), link),
    )?
    .with_dram_probes(&dram_probes, device != "cuda");
    let bound = Bound::of(&traffic, &rates);
    let predicted = running.predicted_tokens_per_s();
    if let (Some(path), Some(log)) = (&a.trace, &log) {
        phases::write_trace(path, &phases::chrome_trace(log, &spec.name, device))?;
    }
    let decode_totals = log.as_ref().map(phases::decode_totals);
    let phase_totals = decode_totals
        .as_ref()
        .map(|t| phases::per_token_json(t, &rates, (m.after_prefill, m.end)));
    // The running mode's plan, resource by resource, beside the traced phases.
    let sparse_per_token = running.sparse_plan().map(|s| s.per_token);
    let plan_vs_trace = decode_totals
        .as_ref()
        .zip(running.plan.as_ref())
        .map(|(t, p)| {
            phases::plan_vs_trace_json(t, &phases::PlannedCosts::of(p, sparse_per_token), &rates)
        });
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
    // What the expert units and the CPU did over the bench's calls (prompts and decode), against
    // what the plan expected per token.
    let experts = running.experts.as_ref().map(|x| {
        let c = x.traffic.snapshot();
        json!({"mode": x.plan.mode, "slots": x.plan.slots(), "copies_per_step": x.plan.copies_per_step,
               "totals": c, "hit_ratio": c.hit_ratio(), "prefetch": x.plan.prefetch,
               "guess_precision": c.guess_precision(),
               "expected_hit_ratio": x.plan.layers.iter().map(|l| l.hit_ratio).sum::<f64>()
                   / x.plan.layers.len().max(1) as f64,
               "expected_per_token": x.plan.per_token, "device_bytes": x.plan.device.total,
               "routing": x.plan.routing})
    });
    let predictors = predictors_json(a, &loaded, &running, &prompt)?;
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
        "decode_tokens_per_s": m.decode_tokens_per_s, "traced_decode_tokens_per_s": m.traced_decode_tokens_per_s,
        "bound": format!("{} (bytes per token ÷ rate)", bound.limited_by),
        "bound_limited_by": bound.limited_by, "bound_tokens_per_s": bound.tokens_per_s,
        "bound_seconds": bound.seconds, "fraction_of_bound": m.decode_tokens_per_s / bound.tokens_per_s,
        "predicted_tokens_per_s": predicted, "rates": rates,
        "load_s": running.load_s, "memory": memory, "hybrid": cold, "cache_units": units, "experts": experts,
        "predictors": predictors, "phases_per_token": phase_totals, "plan_vs_trace_per_token": plan_vs_trace,
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
    let n = a.sessions[0] as usize;
    let ctx = sessions_ctx(a, spec.max_context)?;
    let running = loaded.start(&a.model, sessions_job(a, n))?;
    let prompts = sessions_prompts(a, n, spec.vocab_size);
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
            many.push(decode_together(e, &prompts, ctx, a.tokens)?);
        }
        (one, many)
    });
    let (one, many) = (measure::median(one), measure::median(many));
    let predicted = running.predicted_tokens_per_s();
    let out = json!({
        "model": spec.name, "device": device_of(&running), "sessions": n,
        "prompt_tokens": a.prompt_tokens, "decode_tokens": a.tokens, "reps": a.reps,
        "single_decode_tokens_per_s": one, "aggregate_decode_tokens_per_s": many,
        "speedup": many / one, "cold": running.cold_mode(),
        "predicted_aggregate_tokens_per_s": predicted,
        "prefill_layout": running.plan.as_ref().map(|p| p.prefill),
    });
    Ok(SessionsRun {
        model: spec.name,
        device: device_of(&running),
        sessions: n,
        single_tokens_per_s: one,
        aggregate_tokens_per_s: many,
        predicted_tokens_per_s: predicted,
        json: out,
    })
}

/// Positions each of the sequences needs: the prompt, the tokens decoded, one more.
fn sessions_ctx(a: &DecodeArgs, max_context: usize) -> Result<usize> {
    let ctx = a.prompt_tokens + a.tokens + 1;
    if ctx > max_context {
        bail!("{ctx} positions exceed the model's maximum of {max_context}");
    }
    Ok(ctx)
}

/// The job of `n` sequences decoded together: a KV cache and a logits row each.
fn sessions_job(a: &DecodeArgs, n: usize) -> Job {
    let ctx = a.prompt_tokens + a.tokens + 1;
    Job {
        sessions: n,
        logit_rows: n,
        ..Job::single(ctx, a.prompt_tokens.max(n), 1)
    }
}

/// A different random prompt for each of `n` sequences.
fn sessions_prompts(a: &DecodeArgs, n: usize, vocab: usize) -> Vec<Vec<u32>> {
    (0..n)
        .map(|i| random_prompt_seeded(a.prompt_tokens, vocab, 100 + i as u64))
        .collect()
}

/// Aggregate decode tokens/s of `prompts.len()` sequences decoded together, `tokens` each, in
/// batched steps of as many as a step holds (one step per token of each where all fit).
fn decode_together<B: Backend>(
    e: &Engine<B>,
    prompts: &[Vec<u32>],
    ctx: usize,
    tokens: usize,
) -> Result<f64> {
    let argmax = crate::engine::sampler::argmax;
    let mut ss = Vec::with_capacity(prompts.len());
    let mut last = Vec::with_capacity(prompts.len());
    for p in prompts {
        let mut s = e.new_session(ctx)?;
        last.push(argmax(&e.forward(
            &mut s,
            p,
            crate::engine::Logits::Last,
        )?));
        ss.push(s);
    }
    let group = e.prefill().group.max(1);
    let t0 = Instant::now();
    for _ in 0..tokens {
        let mut calls: Vec<_> = ss.iter_mut().zip(&last).map(|(s, &t)| (s, t)).collect();
        let mut out = Vec::with_capacity(prompts.len());
        for c in calls.chunks_mut(group) {
            out.extend(e.decode_many(c)?);
        }
        last = out.iter().map(|l| argmax(l)).collect();
    }
    Ok((prompts.len() * tokens) as f64 / t0.elapsed().as_secs_f64())
}

/// One count of sequences under one `--cold` mode.
pub struct BatchRow {
    pub mode: Cold,
    pub sessions: usize,
    /// What ran the neurons that do not fit (the choice of `auto`).
    pub runs: Option<&'static str>,
    pub predicted_tokens_per_s: Option<f64>,
    /// Measured aggregate decode tokens/s, or why the mode could not run.
    pub measured: std::result::Result<f64, String>,
}

/// `bench decode --sessions 1,4,16 [--modes …]`: every count under every mode.
pub struct BatchesRun {
    pub model: String,
    pub device: &'static str,
    pub rows: Vec<BatchRow>,
    /// Everything, as `--json` prints it.
    pub json: Value,
}

/// Each count of `--sessions` under each of `--modes` (or `--cold`): a fresh engine under the
/// plan for that many sequences, its decode steps timed with all of them together.
fn run_batches(a: &DecodeArgs) -> Result<BatchesRun> {
    let loaded = LoadedModel::load(&a.model)?;
    let spec = loaded.spec().clone();
    let modes = if a.modes.is_empty() {
        vec![a.model.budget.cold]
    } else {
        a.modes.clone()
    };
    let most = a.sessions.iter().copied().max().unwrap_or(1) as usize;
    let ctx = sessions_ctx(a, spec.max_context)?;
    let prompts = sessions_prompts(a, most, spec.vocab_size);
    let mut rows = Vec::new();
    let mut device = "";
    for &mode in &modes {
        let mut args = a.model.clone();
        args.budget.cold = mode;
        for &n in &a.sessions {
            let n = n as usize;
            let row = match loaded.start(&args, sessions_job(a, n)) {
                Ok(running) => {
                    device = device_of(&running);
                    let measured = with_engine!(&running.engine, e => {
                        let mut runs = Vec::with_capacity(a.reps);
                        for _ in 0..a.reps {
                            runs.push(decode_together(e, &prompts[..n], ctx, a.tokens));
                        }
                        runs.into_iter().collect::<Result<Vec<f64>>>()
                    });
                    BatchRow {
                        mode,
                        sessions: n,
                        runs: running.cold_mode(),
                        predicted_tokens_per_s: running.predicted_tokens_per_s(),
                        measured: measured.map(measure::median).map_err(|e| format!("{e:#}")),
                    }
                }
                Err(e) => BatchRow {
                    mode,
                    sessions: n,
                    runs: None,
                    predicted_tokens_per_s: None,
                    measured: Err(format!("{e:#}")),
                },
            };
            rows.push(row);
        }
    }
    let out = json!({
        "model": spec.name, "device": device, "prompt_tokens": a.prompt_tokens,
        "decode_tokens": a.tokens, "reps": a.reps,
        "rows": rows.iter().map(|r| json!({
            "mode": r.mode, "sessions": r.sessions, "runs": r.runs,
            "predicted_aggregate_tokens_per_s": r.predicted_tokens_per_s,
            "aggregate_decode_tokens_per_s": r.measured.as_ref().ok(),
            "error": r.measured.as_ref().err(),
        })).collect::<Vec<_>>(),
    });
    Ok(BatchesRun {
        model: spec.name,
        device,
        rows,
        json: out,
    })
}
