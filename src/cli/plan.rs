//! `gpu-offload plan`: where every byte of a model lives for a budget, per layer, with totals
//! and the predicted speed.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;

use super::store::open_store_for;
use crate::plan::{Budget, HardwareProfile};

/// Flags shared by everything that runs under a memory budget.
#[derive(Debug, Args)]
pub struct BudgetArgs {
    /// Device memory budget, e.g. 4G, 512M, 4GiB.
    #[arg(long, env = "GPU_OFFLOAD_GPU_MEM", value_parser = parse_bytes)]
    pub gpu_mem: Option<u64>,

    /// Host memory for the model's weights (DRAM cache); beyond it, layers are re-read from SSD.
    #[arg(long, env = "GPU_OFFLOAD_DRAM_MEM", value_parser = parse_bytes)]
    pub dram_mem: Option<u64>,

    /// Where the FFN neurons that do not fit the device run: stream (copied in per token, all
    /// computed on the device); split (bundled FFNs: the planner has the CPU compute the last of
    /// them from DRAM, as many as take it as long as the copies of the rest); cpu (hybrid: the
    /// neurons the sparsity profile says fire most stay on the device, chosen by the exact ILP,
    /// the CPU computes the others; attention resident, or streamed beside the hot neurons where
    /// it does not all fit; needs `gpu-offload profile`); gpu (cache units, bundled FFNs: a unit
    /// of neuron slots per layer on the device, only the neurons a token needs and the unit
    /// lacks copied in, all computed on the device; needs `gpu-offload profile`); auto
    /// (the fastest of these by the plan's prediction, with each layer a cache unit or hybrid,
    /// whichever is faster there; hybrid and units only where a profile exists)
    #[arg(long, env = "GPU_OFFLOAD_COLD", value_enum, default_value = "auto")]
    pub cold: crate::plan::hybrid::Cold,

    /// Precision of the neurons cache units (--cold gpu) compute: fp16; A/B/C, the percent of
    /// each token's active neurons, ranked by the predictor's score (by the activation's
    /// magnitude with oracle masks), computed in f16, INT8 and INT4 (e.g. 25/25/50; the store
    /// needs int8 and int4 bundles: convert --encodings int8,int4); auto, the fastest by the
    /// plan of the shares `gpu-offload bench precision` found within its tolerance of fp16's
    /// perplexity (fp16 where no search was saved)
    #[arg(long, env = "GPU_OFFLOAD_NEURON_PRECISION", default_value = "auto")]
    pub neuron_precision: crate::plan::precision::NeuronPrecision,

    /// Most rows one prefill step takes. By default as many as the device holds beside every
    /// layer, up to 4096 (a whole GPU: larger GEMMs, fewer launches; the CPU: as many as 1 GiB
    /// of step buffers holds), else 512; a long prompt runs in steps of this many rows, each
    /// layer's weights once per prompt.
    #[arg(long, env = "GPU_OFFLOAD_PREFILL_STEP", value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub prefill_step: Option<u32>,

    /// Layers streamed ahead of compute.
    #[arg(long, env = "GPU_OFFLOAD_PREFETCH_WINDOW", default_value_t = 3, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub prefetch_window: u16,

    /// Hardware profile for the cost model: a preset name (configs/) or a JSON file
    /// [default: the profile `doctor --save` measured, else cpu-sim for --device sim, gpu-4g otherwise]
    #[arg(long, env = "GPU_OFFLOAD_HARDWARE")]
    pub hardware: Option<String>,

    /// Run as on another card: a preset (configs/, e.g. rtx3060-12g) whose memory caps --gpu-mem
    /// and whose PCIe rate paces host→device copies; its profile becomes the cost model's.
    #[arg(long, env = "GPU_OFFLOAD_EMULATE")]
    pub emulate: Option<String>,
}

impl BudgetArgs {
    /// Most rows a prefill step takes (`--prefill-step`, else [`crate::footprint::MAX_GROUP`]).
    pub fn max_step(&self) -> usize {
        self.prefill_step
            .map_or(crate::footprint::MAX_GROUP, |s| s as usize)
    }

    /// The neuron precisions cache units may run at for `store` (`--neuron-precision`): the
    /// one given, or a saved search's good ones (all-f16 without a search, or where the search
    /// was made at another sparsity than `target`).
    pub fn precisions(
        &self,
        store: &crate::store::Store,
        target: f64,
    ) -> Result<Vec<crate::plan::precision::Precision>> {
        use crate::plan::precision::{NeuronPrecision, Precision, PrecisionSearch};
        match self.neuron_precision {
            NeuronPrecision::Fixed(p) => Ok(vec![p]),
            NeuronPrecision::Auto => {
                match PrecisionSearch::load(store.dir(), &store.manifest.model_id)? {
                    Some(s) if (s.target - target).abs() < 1e-9 => {
                        let good = s.good();
                        tracing::info!(
                            "--neuron-precision auto: within {:.1}% of fp16's perplexity: {}",
                            s.tolerance * 100.0,
                            good.iter()
                                .map(|p| p.to_string())
                                .collect::<Vec<_>>()
                                .join(", ")
                        );
                        Ok(if good.is_empty() {
                            vec![Precision::FP16]
                        } else {
                            good
                        })
                    }
                    Some(s) => {
                        tracing::info!(
                            "--neuron-precision auto: the saved search is at {:.0}% sparsity, this run at {:.0}%: fp16",
                            s.target * 100.0,
                            target * 100.0
                        );
                        Ok(vec![Precision::FP16])
                    }
                    None => Ok(vec![Precision::FP16]),
                }
            }
        }
    }

    /// The cost model's profile: `--hardware`, else the measured profile, else `default` — as
    /// the `--emulate`d card would run on it (its memory, fixed cost and PCIe rate).
    pub fn hardware_profile(&self, default: &str) -> Result<HardwareProfile> {
        let base = match &self.hardware {
            Some(h) => HardwareProfile::load(h),
            None => HardwareProfile::saved_or(default),
        }
        .map_err(anyhow::Error::msg)?;
        match &self.emulate {
            Some(card) => Ok(base.emulating(
                &HardwareProfile::load(card).map_err(|e| anyhow::anyhow!("--emulate: {e}"))?,
            )),
            None => Ok(base),
        }
    }
}

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
    pub kv_type: Option<super::KvTypeArg>,

    /// Sequences at once (as `serve --parallel`): one step returns logits of each, and each
    /// holds a cache of --ctx-size, or a block table into --kv-pool-tokens.
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
    #[arg(long, env = "GPU_OFFLOAD_SPARSITY_TARGET", default_value_t = super::load::DEFAULT_SPARSITY_TARGET)]
    pub sparsity_target: f64,

    /// Print the plan as JSON.
    #[arg(long, env = "GPU_OFFLOAD_JSON")]
    pub json: bool,
}

/// "4G", "4GiB", "512M", "1.5g", "1048576" → bytes (binary units).
pub fn parse_bytes(s: &str) -> std::result::Result<u64, String> {
    let t = s.trim();
    let lower = t.to_ascii_lowercase();
    let (num, mult) = [
        ("tib", 40),
        ("gib", 30),
        ("mib", 20),
        ("kib", 10),
        ("tb", 40),
        ("gb", 30),
        ("mb", 20),
        ("kb", 10),
        ("t", 40),
        ("g", 30),
        ("m", 20),
        ("k", 10),
        ("b", 0),
    ]
    .iter()
    .find_map(|(suffix, shift)| {
        lower
            .strip_suffix(suffix)
            .map(|n| (n.trim().to_string(), 1u64 << shift))
    })
    .unwrap_or((lower.clone(), 1));
    let v: f64 = num
        .parse()
        .map_err(|_| format!("`{s}` is not a size (examples: 4G, 512M, 4GiB)"))?;
    if !(v.is_finite() && v > 0.0) {
        return Err(format!("`{s}` must be a positive size"));
    }
    let bytes = v * mult as f64;
    if bytes > u64::MAX as f64 / 2.0 {
        return Err(format!("`{s}` is too large"));
    }
    Ok(bytes as u64)
}

pub fn run(a: PlanArgs) -> Result<()> {
    let hw = a.budget.hardware_profile("gpu-4g")?;
    let gpu_mem = match (a.budget.gpu_mem, &a.budget.emulate) {
        (Some(g), _) => g,
        (None, Some(_)) => hw.device_bytes,
        (None, None) => {
            anyhow::bail!("give the device memory budget with --gpu-mem (e.g. --gpu-mem 4G)")
        }
    };
    let store = open_store_for(&a.model)?;
    let spec = &store.manifest.spec;
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
        logit_rows: sessions,
        kv_pool: a
            .kv_pool_tokens
            .map(|t| (t as usize).div_ceil(crate::backend::KV_BLOCK)),
        ..budget
    };
    let name = a.model.display().to_string();
    let profile_path = crate::sparsity::SparsityProfile::path_in(store.dir());
    let cold = a.budget.cold;
    let wants_profile = a.hot_neurons
        || cold == crate::plan::hybrid::Cold::Cpu
        || cold == crate::plan::hybrid::Cold::Gpu
        || (cold == crate::plan::hybrid::Cold::Auto && profile_path.exists());
    if a.hot_neurons && !(0.01..=0.99).contains(&a.sparsity_target) {
        anyhow::bail!(
            "--sparsity-target {} is outside 0.01..=0.99",
            a.sparsity_target
        );
    }
    let profile = if wants_profile {
        Some(crate::sparsity::SparsityProfile::load(
            store.dir(),
            &store.manifest.model_id,
            &name,
        )?)
    } else {
        None
    };
    let crate::plan::hybrid::ColdChoice {
        plan,
        hot: chosen_hot,
        units,
        candidates,
    } = crate::plan::hybrid::plan_cold(
        &store.manifest,
        &budget,
        &hw,
        cold,
        profile.as_ref().map(|p| (p, a.sparsity_target)),
        &a.budget.precisions(&store, a.sparsity_target)?,
    )?;
    // What runs the neurons that do not fit.
    let chosen = if chosen_hot.is_some() {
        "cpu"
    } else if units.is_some() {
        "gpu"
    } else if plan.residency.cpu_rows > 0 {
        "split"
    } else {
        "stream"
    };
    let hot = match (&profile, chosen_hot) {
        (_, Some(h)) => Some(h),
        (Some(p), None) if a.hot_neurons => Some(crate::plan::hybrid::plan_hot_neurons(
            &store.manifest,
            &plan,
            p,
            a.sparsity_target,
        )?),
        _ => None,
    };
    if a.json {
        let mut v = serde_json::to_value(&plan)?;
        if let Some(h) = &hot {
            v["hot_neurons"] = serde_json::to_value(h)?;
        }
        if let Some(u) = &units {
            v["cache_units"] = serde_json::to_value(u)?;
        }
        v["cold_candidates"] = serde_json::to_value(&candidates)?;
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
            println!(
                "--cold auto chose {chosen} (predicted: {})",
                list.join(", ")
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::parse_bytes;

    #[test]
    fn sizes_parse_in_binary_units() {
        assert_eq!(parse_bytes("4G").unwrap(), 4 << 30);
        assert_eq!(parse_bytes("4GiB").unwrap(), 4 << 30);
        assert_eq!(parse_bytes("512m").unwrap(), 512 << 20);
        assert_eq!(parse_bytes("1.5G").unwrap(), 3 << 29);
        assert_eq!(parse_bytes("1000").unwrap(), 1000);
        assert!(parse_bytes("-1G").is_err());
        assert!(parse_bytes("lots").is_err());
        assert!(parse_bytes("0").is_err());
    }
}
