//! `gpu-offload plan`: where every byte of a model lives for a budget, per layer, with totals
//! and the predicted speed.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;

use crate::model::ModelSpec;
use crate::plan::Budget;
use crate::runtime::BudgetArgs;
use crate::runtime::planning::{StorePlan, plan_store};
use crate::runtime::rates::RatesDevice;
use crate::runtime::store::open_store_for;

#[derive(Debug, Args)]
pub struct PlanArgs {
    /// Store directory, GGUF file or HF directory (converted into the cache on first use).
    #[arg(long, short = 'm', env = "GPU_OFFLOAD_MODEL")]
    pub model: PathBuf,

    #[command(flatten)]
    pub budget: BudgetArgs,

    /// KV cache positions to plan for [default: the model's maximum context, at most 4096]
    #[arg(long, env = "GPU_OFFLOAD_CTX_SIZE")]
    pub ctx_size: Option<usize>,

    /// Most tokens one step evaluates (prefill batch), 1 to 512: a longer prompt runs in steps
    /// (where the device holds every layer, in steps of up to --prefill-step).
    #[arg(long, env = "GPU_OFFLOAD_BATCH", default_value_t = 512)]
    pub batch: usize,

    /// Plan the prefill of a prompt this long: how it is partitioned under the budget (row
    /// groups per layer, where the hidden states and the KV cache live) and its predicted time
    /// to first token [default: one step of --batch]. The context grows to hold it.
    #[arg(long, env = "GPU_OFFLOAD_PROMPT_TOKENS", value_parser = clap::value_parser!(u64).range(1..))]
    pub prompt_tokens: Option<u64>,

    /// KV cache element type on the device [default: f16]
    #[arg(long, env = "GPU_OFFLOAD_KV_TYPE", value_enum)]
    pub kv_type: Option<crate::runtime::KvTypeArg>,

    /// Sequences at once (as `serve --parallel`): one decode step evaluates a token of each and
    /// returns logits of each, and each holds a cache of --ctx-size, or a block table into
    /// --kv-pool-tokens. Each mode (stream, split, hybrid, cache units) is costed for steps of
    /// this many sequences and its predicted tokens/s is their aggregate.
    #[arg(long, env = "GPU_OFFLOAD_PARALLEL", default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=256))]
    pub parallel: u16,

    /// Plan a paged KV pool of this many positions shared by the sequences (as `serve
    /// --kv-pool-tokens`) instead of a cache of --ctx-size each.
    #[arg(long, env = "GPU_OFFLOAD_KV_POOL_TOKENS", value_parser = clap::value_parser!(u64).range(1..))]
    pub kv_pool_tokens: Option<u64>,

    /// Also place hot FFN neurons as PowerInfer does (everything else resident, the budget left
    /// for the neurons that fire most at --sparsity-target, by exact ILP); needs the model's
    /// sparsity profile (`gpu-offload profile`).
    #[arg(long, env = "GPU_OFFLOAD_HOT_NEURONS")]
    pub hot_neurons: bool,

    /// Sparsity the hot-neuron placement takes the activation frequencies at.
    #[arg(long, env = "GPU_OFFLOAD_SPARSITY_TARGET", default_value_t = crate::runtime::DEFAULT_SPARSITY_TARGET,
          value_parser = crate::runtime::parse_share)]
    pub sparsity_target: f64,

    /// How the planned run decides each step's neurons, as `run --sparsity` (off plans as
    /// oracle): oracle (the threshold's mask: every deciding vector read) or predicted (the
    /// profile's predictors: their weights read, the neurons they name examined; the frequencies
    /// of the target they were trained for).
    #[arg(
        long,
        env = "GPU_OFFLOAD_SPARSITY",
        value_enum,
        default_value = "oracle"
    )]
    pub sparsity: crate::runtime::SparsityMode,

    /// Print the plan as JSON.
    #[arg(long, env = "GPU_OFFLOAD_JSON")]
    pub json: bool,
}

pub fn run(a: PlanArgs) -> Result<()> {
    // The device a run would take: the GPU where there is one, else the budgeted CPU device.
    let hw = if crate::backend::cuda::device_available() {
        a.budget.hardware_profile(RatesDevice::Cuda, "gpu-4g", 0)?
    } else {
        a.budget.hardware_profile(RatesDevice::Sim, "cpu-sim", 0)?
    };
    let gpu_mem = match (a.budget.gpu_mem, &a.budget.emulate) {
        (Some(g), _) => g,
        (None, Some(_)) => hw.device_bytes,
        (None, None) => {
            anyhow::bail!("give the device memory budget with --gpu-mem (e.g. --gpu-mem 4G)")
        }
    };
    let store = open_store_for(&a.model)?;
    let budget = budget_of(&a, &store.manifest.spec, gpu_mem)?;
    if store.manifest.spec.moe.is_some() {
        return print_expert_plan(&a, &store, &budget, &hw);
    }
    let name = a.model.display().to_string();
    let planned = plan_store(
        &store,
        &name,
        &budget,
        &hw,
        &a.budget,
        a.hot_neurons,
        a.sparsity_target,
    )?;
    print_plan(&a, planned, &budget)
}

/// A mixture-of-experts model's plan: the expert units (or every routed expert on the CPU) for
/// `--cold`, as JSON or as the report.
fn print_expert_plan(
    a: &PlanArgs,
    store: &crate::store::Store,
    budget: &Budget,
    hw: &crate::plan::HardwareProfile,
) -> Result<()> {
    use crate::plan::experts::{ExpertMode, plan_experts};
    if a.hot_neurons {
        anyhow::bail!(
            "--hot-neurons places FFN neurons; a mixture-of-experts model's unit is the expert \
             (its plan shows the expert slots per layer)"
        );
    }
    let mode = ExpertMode::for_cold(a.budget.cold)?;
    let routing = crate::runtime::planning::routing_profile(store, &a.model.display().to_string())?;
    let ep = plan_experts(&store.manifest, budget, hw, mode, routing.as_ref())?;
    if a.json {
        let mut v = serde_json::to_value(&ep.plan)?;
        v["experts"] = serde_json::to_value(&ep)?;
        v["prefill_prediction"] = serde_json::to_value(ep.prefill_prediction(budget.prompt))?;
        v["cold"] = match ep.mode {
            ExpertMode::Cpu => "cpu",
            ExpertMode::Units => "gpu",
            ExpertMode::Stream => "stream",
            ExpertMode::Static => "static",
        }
        .into();
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        print!("{}", ep.plan.report());
        print!("{}", ep.report());
    }
    Ok(())
}

/// The budget the flags ask to plan for a model of `spec` on a device of `gpu_mem` bytes.
fn budget_of(a: &PlanArgs, spec: &ModelSpec, gpu_mem: u64) -> Result<Budget> {
    let prompt = a.prompt_tokens.map(|p| p as usize);
    if let Some(p) = prompt
        && p > spec.max_context
    {
        anyhow::bail!(
            "--prompt-tokens {p} exceeds the model's maximum context of {} positions",
            spec.max_context
        );
    }
    let ctx = a
        .ctx_size
        .unwrap_or(spec.max_context.min(4096).max(prompt.unwrap_or(0)));
    if ctx == 0 || ctx > spec.max_context {
        anyhow::bail!(
            "--ctx-size {ctx} must be between 1 and the model's maximum of {}",
            spec.max_context
        );
    }
    if let Some(p) = prompt
        && p > ctx
    {
        anyhow::bail!("--prompt-tokens {p} does not fit --ctx-size {ctx}");
    }
    if !(1..=crate::footprint::MAX_BATCH).contains(&a.batch) {
        anyhow::bail!(
            "--batch {} must be between 1 and {} (a longer prompt runs in steps of it; where \
             the device holds every layer, --prefill-step sets larger ones)",
            a.batch,
            crate::footprint::MAX_BATCH
        );
    }
    let batch = a.batch;
    let batch = a
        .budget
        .prefill_step
        .map_or(batch, |s| batch.min(s as usize));
    let budget = Budget {
        kv_type: a
            .kv_type
            .map_or(crate::backend::KvType::F16, |k| k.kv_type()),
        ..Budget::new(
            gpu_mem,
            a.budget.dram_mem,
            a.budget.prefetch_window as usize,
            ctx,
            batch,
        )
    };
    let sessions = a.parallel as usize;
    let budget = Budget {
        prompt: prompt.unwrap_or(batch),
        max_step: a.budget.max_step(),
        sessions,
        sequences: sessions,
        logit_rows: sessions,
        kv_pool: a
            .kv_pool_tokens
            .map(|t| (t as usize).div_ceil(crate::backend::KV_BLOCK)),
        predicted: a.sparsity == crate::runtime::SparsityMode::Predicted,
        ..budget
    };
    Ok(budget)
}

/// The plan (with its hot neurons and cache units), as JSON or as the report.
fn print_plan(a: &PlanArgs, planned: StorePlan, budget: &Budget) -> Result<()> {
    let StorePlan {
        plan,
        hot,
        units,
        candidates,
        chosen,
    } = planned;
    if a.json {
        let mut v = serde_json::to_value(&plan)?;
        if let Some(h) = &hot {
            v["hot_neurons"] = serde_json::to_value(h)?;
        }
        if let Some(u) = &units {
            v["cache_units"] = serde_json::to_value(u)?;
        }
        // Each candidate's predicted aggregate tokens/s for --parallel sequences a step.
        v["cold_candidates"] = serde_json::to_value(&candidates)?;
        v["sequences"] = plan.prediction.step.sequences.into();
        v["cold"] = chosen.into();
        v["prefill_prediction"] = serde_json::to_value(plan.prefill_prediction(budget.prompt))?;
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        print!("{}", plan.report());
        if let Some(h) = &hot {
            print!("{}", h.report());
        }
        if let Some(u) = &units {
            print!("{}", u.report());
        }
        if candidates.len() > 1 {
            let list: Vec<String> = candidates
                .iter()
                .map(|(c, t)| format!("{c:?} {t:.2} tok/s").to_lowercase())
                .collect();
            let of = match plan.prediction.step.sequences {
                1 => String::new(),
                n => format!(", in all for steps of {n} sequences"),
            };
            println!(
                "--cold auto chose {chosen} (predicted{of}: {})",
                list.join(", ")
            );
        }
    }
    Ok(())
}
