//! The options an engine is assembled from, as flags (and `GPU_OFFLOAD_*` variables) every
//! command that loads a model shares: the model, the device, the budget, the KV type, sparsity,
//! and where the prompt comes from. `cli`, `serve` and `bench` flatten these into their own
//! flags; the runtime reads them.

use std::path::PathBuf;

use anyhow::Result;
use clap::{Args, ValueEnum};

use crate::plan::HardwareProfile;

/// Where the math runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Device {
    /// A GPU when one is present; else the budgeted CPU device when --gpu-mem is given, else
    /// the CPU.
    Auto,
    /// The CPU backend: every weight used in place, in its file format.
    Cpu,
    /// The budgeted device: the CPU standing in for a GPU of --gpu-mem, weights offloaded from
    /// the store through DRAM and SSD exactly as on a GPU, every byte counted.
    Sim,
    /// An NVIDIA GPU (CUDA).
    Cuda,
}

/// Flags shared by every command that loads a model.
#[derive(Clone, Debug, Args)]
pub struct ModelArgs {
    /// GGUF file or Hugging Face model directory [default: the model scripts/fetch-models.sh
    /// downloads, SmolLM2-135M-Instruct Q4_1, in $GPU_OFFLOAD_MODELS or ~/.cache/gpu-offload/models]
    #[arg(long, short = 'm', env = "GPU_OFFLOAD_MODEL")]
    pub model: Option<PathBuf>,

    /// Worker threads for the CPU backend [default: one per core]
    #[arg(long, short = 't', env = "GPU_OFFLOAD_THREADS", value_parser = clap::value_parser!(u16).range(1..=1024))]
    pub threads: Option<u16>,

    /// Device to run on.
    #[arg(long, env = "GPU_OFFLOAD_DEVICE", value_enum, default_value = "auto")]
    pub device: Device,

    /// CPU kernel set: avx512vnni, avx2 or portable [default: the best this CPU runs]
    #[arg(long, env = "GPU_OFFLOAD_KERNELS")]
    pub cpu_kernels: Option<String>,

    #[command(flatten)]
    pub budget: BudgetArgs,

    /// Context size in tokens [default: what the job needs, at most the model's maximum]
    #[arg(long, env = "GPU_OFFLOAD_CTX_SIZE", value_parser = clap::value_parser!(u32).range(1..))]
    pub ctx_size: Option<u32>,

    /// KV cache element type: f16, f32 or q8_0 [default: f16 on a device (cuda, sim), f32 on
    /// the CPU]
    #[arg(long, env = "GPU_OFFLOAD_KV_TYPE", value_enum)]
    pub kv_type: Option<KvTypeArg>,

    /// FFN activation sparsity: off (every neuron computed); oracle (each token's exact mask:
    /// neurons whose activation magnitude is at most the layer's threshold for
    /// --sparsity-target contribute nothing; SwiGLU models need `gpu-offload profile` first);
    /// predicted (the profile's per-layer predictors choose the neurons from the layer's input).
    #[arg(long, env = "GPU_OFFLOAD_SPARSITY", value_enum, default_value = "off")]
    pub sparsity: SparsityMode,

    /// Share of FFN neurons to skip, 0.01–0.99 [default: 0 for ReLU models (their natural
    /// sparsity, exact), else 0.15, what SmolLM2-135M tolerates within 1% perplexity]
    #[arg(long, env = "GPU_OFFLOAD_SPARSITY_TARGET", value_parser = parse_share)]
    pub sparsity_target: Option<f64>,

    /// Record each sequence's one-token decode step as a CUDA graph once and replay it (one
    /// launch a token instead of one a kernel). Steps with weights resident on the device only;
    /// others run as before. On the budgeted device (`--device sim`) the steps are recorded as
    /// CUDA would and every replay is checked against its recording. [default: on for CUDA
    /// (a replay equals the launched kernels bit for bit), off elsewhere; `--cuda-graphs=false`
    /// or GPU_OFFLOAD_CUDA_GRAPHS=false turns it off]
    #[arg(long, env = "GPU_OFFLOAD_CUDA_GRAPHS", num_args = 0..=1, require_equals = true,
          default_missing_value = "true", value_parser = clap::builder::BoolishValueParser::new(),
          overrides_with = "no_cuda_graphs")]
    pub cuda_graphs: Option<bool>,

    /// Launch every kernel of a decode step, recording none (`--cuda-graphs=false`).
    #[arg(long, overrides_with = "cuda_graphs")]
    pub no_cuda_graphs: bool,

    /// Launch each CUDA kernel with programmatic stream serialization (programmatic dependent
    /// launch): its blocks are scheduled while the kernel before it finishes and wait for its
    /// results, so launches overlap (recorded steps too). Whole-GPU runs (no --gpu-mem) on
    /// compute capability 9.0 (Hopper) with kernels built for it (`CUDA_COMPUTE_CAP=90` at build
    /// time, or NVRTC); refused elsewhere.
    #[arg(long, env = "GPU_OFFLOAD_PROGRAMMATIC_LAUNCH")]
    pub programmatic_launch: bool,
}

impl ModelArgs {
    /// Whether decode steps are recorded (`--cuda-graphs`) on `device` (the one the model runs
    /// on): as asked, else on CUDA only.
    pub fn cuda_graphs_on(&self, device: Device) -> bool {
        if self.no_cuda_graphs {
            return false;
        }
        self.cuda_graphs.unwrap_or(device == Device::Cuda)
    }
}

/// `--sparsity`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum SparsityMode {
    Off,
    Oracle,
    /// The profile's predictors pick each token's neurons from the layer's input.
    Predicted,
}

/// `--kv-type`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum KvTypeArg {
    /// Half the bytes of f32; on CUDA (Ampere and newer) a prompt's attention runs on tensor cores
    F16,
    /// Full precision, also in a CUDA prompt's attention (CUDA cores: slower for long prompts)
    F32,
    /// 8-bit blocks as llama.cpp quantizes them (~0.27 of f32's bytes); on CUDA (Ampere and
    /// newer) a prompt's attention runs on tensor cores
    #[value(name = "q8_0")]
    Q8_0,
}

impl KvTypeArg {
    pub fn kv_type(self) -> crate::backend::KvType {
        match self {
            KvTypeArg::F16 => crate::backend::KvType::F16,
            KvTypeArg::F32 => crate::backend::KvType::F32,
            KvTypeArg::Q8_0 => crate::backend::KvType::Q8_0,
        }
    }
}

/// Where the input tokens come from.
#[derive(Debug, Args)]
#[group(required = true, multiple = false)]
pub struct PromptArgs {
    /// Prompt text.
    #[arg(long, short = 'p', env = "GPU_OFFLOAD_PROMPT")]
    pub prompt: Option<String>,

    /// Read the prompt from a file.
    #[arg(long, env = "GPU_OFFLOAD_PROMPT_FILE")]
    pub prompt_file: Option<PathBuf>,

    /// Token ids, comma-separated (for models without a tokenizer), e.g. 1,15043,3186.
    #[arg(long, env = "GPU_OFFLOAD_TOKENS", value_delimiter = ',', num_args = 1..)]
    pub tokens: Option<Vec<u32>>,
}

/// Flags shared by everything that runs under a memory budget.
#[derive(Clone, Debug, Args)]
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
    pub cold: crate::plan::choice::Cold,

    /// Precision of the neurons cache units (--cold gpu) compute: fp16; A/B/C, the percent of
    /// each token's active neurons, ranked by the predictor's score (by the activation's
    /// magnitude with oracle masks), computed in f16, INT8 and INT4 (e.g. 25/25/50; the store
    /// needs int8 and int4 bundles: convert --encodings int8,int4); auto, the fastest by the
    /// plan of the shares `gpu-offload bench precision` found within its tolerance of fp16's
    /// perplexity (fp16 where no search was saved)
    #[arg(long, env = "GPU_OFFLOAD_NEURON_PRECISION", default_value = "auto")]
    pub neuron_precision: crate::plan::precision::NeuronPrecision,

    /// Mixture-of-experts models with expert cache units: do not guess each layer's experts from
    /// the previous layer's FFN input (its router applied early) to start their copies before
    /// the layer runs
    #[arg(long, env = "GPU_OFFLOAD_NO_EXPERT_PREFETCH")]
    pub no_expert_prefetch: bool,

    /// Mixture-of-experts models: in a decode step, compute the routed experts the device lacks
    /// that are not their token's most weighted on the device from low-bit copies in this block
    /// format (q4_0, q3_k, q2_k, ...; quantized at load, kept in host memory), the CPU computing
    /// the rest at full precision (HOBBIT). Off by default: it changes the results (`perplexity
    /// --expert-low-bit` measures by how much)
    #[arg(long, env = "GPU_OFFLOAD_EXPERT_LOW_BIT", value_parser = parse_low_bit)]
    pub expert_low_bit: Option<crate::tensor::DType>,

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

    /// The cost model's profile for `device`: `--hardware`, else the saved profile, else this
    /// machine's rates measured at start (cached; `default` names the preset their unmeasured
    /// figures come from) — as the `--emulate`d card would run on it (its memory, fixed cost
    /// and PCIe rate). See [`super::rates`].
    pub fn hardware_profile(
        &self,
        device: super::rates::RatesDevice,
        default: &str,
        threads: usize,
    ) -> Result<HardwareProfile> {
        let base =
            super::rates::planner_profile(self.hardware.as_deref(), device, default, threads)?;
        match &self.emulate {
            Some(card) => Ok(base.emulating(
                &HardwareProfile::load(card).map_err(|e| anyhow::anyhow!("--emulate: {e}"))?,
            )),
            None => Ok(base),
        }
    }
}

/// A share of FFN neurons (`--sparsity-target`, `--predictor-target`): a finite number in
/// 0.01..=0.99, refused at parse time so NaN or 2 never reaches a threshold search.
pub fn parse_share(s: &str) -> std::result::Result<f64, String> {
    let v: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("'{s}' is not a number (a share of neurons, 0.01..=0.99)"))?;
    if (0.01..=0.99).contains(&v) {
        Ok(v)
    } else {
        Err(format!("{s} is outside 0.01..=0.99 (a share of neurons)"))
    }
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

/// A block format for `--expert-low-bit`.
fn parse_low_bit(s: &str) -> Result<crate::tensor::DType, String> {
    match crate::tensor::DType::parse(s) {
        Some(d) if d.is_quantized() => Ok(d),
        _ => Err(format!(
            "{s:?} is not a block format (q4_0, q4_1, q5_0, q8_0, q2_k, q3_k, q4_k, ...)"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::{Device, ModelArgs, parse_bytes, parse_share};

    /// Recorded decode steps are CUDA's default; `--cuda-graphs` asks for them anywhere,
    /// `--no-cuda-graphs` and `--cuda-graphs=false` turn them off, the last flag given winning.
    #[test]
    fn cuda_graphs_are_on_by_default_on_cuda_only() {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            m: ModelArgs,
        }
        let parse = |args: &[&str]| {
            <Cli as clap::Parser>::try_parse_from(std::iter::once("t").chain(args.iter().copied()))
                .unwrap()
                .m
        };
        if std::env::var_os("GPU_OFFLOAD_CUDA_GRAPHS").is_none() {
            let plain = parse(&[]);
            assert!(plain.cuda_graphs_on(Device::Cuda));
            assert!(!plain.cuda_graphs_on(Device::Sim) && !plain.cuda_graphs_on(Device::Cpu));
        }
        let on = parse(&["--cuda-graphs"]);
        assert!(on.cuda_graphs_on(Device::Sim) && on.cuda_graphs_on(Device::Cuda));
        for off in [
            &["--no-cuda-graphs"][..],
            &["--cuda-graphs=false"],
            &["--cuda-graphs", "--no-cuda-graphs"],
        ] {
            assert!(!parse(off).cuda_graphs_on(Device::Cuda), "{off:?}");
        }
        assert!(parse(&["--no-cuda-graphs", "--cuda-graphs"]).cuda_graphs_on(Device::Cuda));
    }

    #[test]
    fn sizes_parse_in_binary_units() {
        assert_eq!(parse_bytes("4G").unwrap(), 4 << 30);
        assert_eq!(parse_bytes("4GiB").unwrap(), 4 << 30);
        assert_eq!(parse_bytes("512m").unwrap(), 512 << 20);
        assert_eq!(parse_share("0.15"), Ok(0.15));
        for bad in ["NaN", "inf", "-0.1", "0", "1", "2", "x", ""] {
            assert!(parse_share(bad).is_err(), "{bad}");
        }
        assert_eq!(parse_bytes("1.5G").unwrap(), 3 << 29);
        assert_eq!(parse_bytes("1000").unwrap(), 1000);
        assert!(parse_bytes("-1G").is_err());
        assert!(parse_bytes("lots").is_err());
        assert!(parse_bytes("0").is_err());
    }
}
